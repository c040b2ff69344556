"""The job's ``weight_sync`` section: how a published weight version reaches the rollout workers
over gRPC (``delta``, ``anchor_every``). Every load is verified whatever it says (the workers'
fingerprints against the trainer's: :mod:`rlfleet.common.tensors.weight_sync`)."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.schema.config import ConfigModel


class WeightSyncSettings(ConfigModel):
    """Delta sync: send a worker only what changed since the version it holds."""

    delta: bool = Field(
        default=False,
        description="send rollout workers that hold the version before only the weights' change (over "
        "gRPC; each worker keeps a host copy of the weights for it)",
    )
    anchor_every: int = Field(
        default=10, ge=1, le=1_000_000,
        description="with delta: every this many versions the whole version goes to every worker",
    )  # fmt: skip
