"""References to bulk data on the tensor plane, the only form in which control messages mention it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TensorRef(BaseModel):
    """Where a dict of tensors lives: a TensorStore's ``host:port``, its key, and the capability to read it.

    The capability (an HMAC of the key under the store's secret, see
    :mod:`rlfleet.common.tensors.guard`) is what the store checks on ``Get``: hand a ref only to
    whom may read it. It is left out of the ref's ``repr`` (and so of logs).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    address: str = Field(description="host:port of the TensorStore gRPC server")
    key: str = Field(description="key the tensors were put under")
    nbytes: int = Field(default=0, ge=0, description="total payload bytes, for accounting")
    capability: str = Field(
        default="", pattern=r"^(?:[0-9a-f]{64})?$", repr=False,
        description="opens this key in its store to read (Get, Stat): the hex HMAC-SHA256, or empty",
    )  # fmt: skip
