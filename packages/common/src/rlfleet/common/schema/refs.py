"""References to bulk data on the tensor plane, the only form in which control messages mention it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TensorRef(BaseModel):
    """Where a dict of tensors lives: a TensorStore's ``host:port`` and the key it is stored under."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    address: str = Field(description="host:port of the TensorStore gRPC server")
    key: str = Field(description="key the tensors were put under")
    nbytes: int = Field(default=0, ge=0, description="total payload bytes, for accounting")
