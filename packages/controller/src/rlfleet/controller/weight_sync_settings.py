"""The job's ``weight_sync`` section: how a published weight version reaches the rollout workers
over gRPC (``delta``, ``anchor_every``; with ``model.lora``, ``adapter``). Every load is verified
whatever it says (the workers' fingerprints against the trainer's:
:mod:`rlfleet.common.tensors.weight_sync`)."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.schema.config import ConfigModel


class WeightSyncSettings(ConfigModel):
    """Send a worker only what changed since the version it holds (delta sync), or a LoRA run's
    adapter alone."""

    delta: bool = Field(
        default=False,
        description="send rollout workers that hold the version before only the weights' change (over "
        "gRPC; each worker keeps a host copy of the weights for it)",
    )
    anchor_every: int = Field(
        default=10, ge=1, le=1_000_000,
        description="with delta: every this many versions the whole version goes to every worker",
    )  # fmt: skip
    adapter: bool = Field(
        default=True,
        description="with model.lora: publish the LoRA adapter alone (megabytes), which the engines apply "
        "to the base they hold (vLLM as a LoRA adapter, without a restart); false: the merged weights",
    )
