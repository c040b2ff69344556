"""Rollout messages: generate jobs and their results, and loading new weights into the engines."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfleet.common.control.messages.base import Message
from rlfleet.common.schema.carriers import IpcBucket, WeightCarrier
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.trainer import LoraSettings

TokenId = Annotated[int, Field(ge=0)]
"""A token id as it arrives: never negative (the engine checks it against its vocabulary too)."""


class SamplingParams(BaseModel):
    """How to sample: mirrors vLLM's SamplingParams for the fields rlfleet uses.

    Every field is bounded where it arrives (a hostile or mistaken request is refused naming the
    field and its value): finite temperature and top-p, top-k -1 or >= 1, bounded lengths and counts.
    """

    model_config = ConfigDict(extra="ignore")

    n: int = Field(default=1, ge=1, le=4096, description="samples per prompt")
    temperature: float = Field(
        default=1.0, ge=0.0, le=100.0, allow_inf_nan=False, description="0 means greedy"
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=-1, ge=-1, le=1 << 20, description="-1 disables top-k (0 is refused)")
    max_tokens: int = Field(default=64, ge=1, le=1 << 20, description="response length cap in tokens")
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=1024, description="besides EOS")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    logprobs: bool = True

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k=0 keeps no token; use -1 to disable top-k or a count >= 1")
        return value


class EpisodeSpec(BaseModel):
    """Run each sample as a multi-turn episode against environment ``env`` (wire 2.8; issue 33).

    The model's turns (each at most ``sampling.max_tokens`` tokens) alternate with the environment's
    observations (:mod:`~rlfleet.common.control.messages.environment`) until the environment says
    done, ``max_turns`` turns have run, or the episode's response (the model's tokens and the
    observations') would pass ``max_episode_tokens`` (cut: reward 0). Every field is bounded; the
    worker bounds the products (prompts x n x ``max_episode_tokens``) with its ``limits``.
    """

    model_config = ConfigDict(extra="ignore")

    env: str = Field(min_length=1, max_length=128, description="the environment endpoint")
    items: list[dict[str, Any]] = Field(
        max_length=1 << 16,
        description="the dataset row of each prompt, as EnvReset carries it (one per prompt)",
    )
    max_turns: int = Field(default=4, ge=1, le=64, description="the model's turns at most")
    max_episode_tokens: int = Field(
        ge=1, le=65536, description="cap on an episode's response tokens, the model's and the observations'"
    )
    max_observation_tokens: int = Field(
        default=256, ge=1, le=65536, description="an observation's tokens beyond it are cut (and counted)"
    )
    env_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="how long one environment request may take",
    )


class GenerateRequest(Message):
    """Generate ``n`` samples for each prompt with weights of ``weight_version`` or newer (a
    pipelined run's worker may have loaded the next version since the job was sent; the reply names
    the version used); a repeated ``job_id`` (a resend after an outage) gets the first job's reply.

    Each field is bounded here; their products (samples, new tokens, prompt tokens, prompt plus
    ``max_tokens`` against the model's context; with ``episode``, ``max_episode_tokens`` in place of
    ``max_tokens``) are bounded by the worker that takes the job (its ``limits``), before any work.
    ``deadline`` is when the requester stops waiting: the worker refuses the job once it has passed
    and cancels a generation still running then.
    """

    kind: Literal["rollout.generate"] = "rollout.generate"
    job_id: str
    prompt_token_ids: list[list[TokenId]] = Field(max_length=1 << 16)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    weight_version: int = Field(
        default=-1, description="the oldest weights the job may use (wire 2.6; before it: exactly these); "
        "-1: whatever the worker holds",
    )  # fmt: skip
    metadata: dict[str, Any] = Field(default_factory=dict)
    deadline: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="wall-clock time (Unix seconds) after which the requester no longer waits: the "
        "worker refuses or cancels the job then (wire 2.5; None: no deadline, as older peers send)",
    )  # fmt: skip
    episode: EpisodeSpec | None = Field(
        default=None,
        description="run each sample as a multi-turn episode against an environment (wire 2.8); "
        "None: one completion per sample",
    )

    @model_validator(mode="after")
    def _one_item_per_prompt(self) -> GenerateRequest:
        if self.episode is not None and len(self.episode.items) != len(self.prompt_token_ids):
            raise ValueError(
                f"episode.items holds {len(self.episode.items)} items for {len(self.prompt_token_ids)} "
                "prompts; give one dataset item per prompt"
            )
        return self


class GenerateResult(Message):
    """Where a finished generate job's batch lives (see the rollout-batch tensor contract)."""

    kind: Literal["rollout.result"] = "rollout.result"
    job_id: str
    worker_id: str
    weight_version: int
    ref: TensorRef
    num_prompts: int
    num_samples: int
    num_tokens: int = Field(default=0, description="generated tokens in the batch")
    seconds: float = 0.0


class LoadWeights(Message):
    """Tell rollout workers to pull new weights, bucket by bucket, and load them in place."""

    kind: Literal["rollout.load_weights"] = "rollout.load_weights"
    weight_version: int
    buckets: list[TensorRef]
    dtype: str = Field(default="", description="dtype the engine should load as; empty: keep")
    ipc_buckets: list[IpcBucket] = Field(
        default_factory=list, description="the same weights shared by CUDA IPC (a worker on that GPU)"
    )
    job_id: str = Field(
        default="", max_length=128,
        description="idempotency key: a repeat (a retry, a resend after an outage) gets the first answer",
    )  # fmt: skip
    keep_from_version: int = Field(
        default=-1, ge=-1,
        description="the worker keeps its stored batches generated at this version or later (a pipelined "
        "run trains them after this load; wire 2.6); -1: only those of the version loaded",
    )  # fmt: skip
    delta_buckets: list[TensorRef] = Field(
        default_factory=list, max_length=1 << 16,
        description="delta sync (wire 2.7): the change from version delta_from to this one "
        "(rlfleet.common.tensors.weight_sync); a worker that holds delta_from loads these instead of buckets",
    )  # fmt: skip
    delta_from: int = Field(default=-1, ge=-1, description="the version delta_buckets apply to; -1: no delta")
    hold: bool = Field(
        default=False, description="keep a host copy of the weights loaded over gRPC, for the next delta"
    )
    adapter: LoraSettings | None = Field(
        default=None,
        description="the buckets hold a LoRA adapter of these settings (wire 2.8): the engine applies it to "
        "the base model it loaded from disk, replacing the adapter it served; None: the whole weights",
    )


class WeightsLoaded(Message):
    """A rollout worker now serves ``weight_version``."""

    kind: Literal["rollout.weights_loaded"] = "rollout.weights_loaded"
    worker_id: str
    weight_version: int
    seconds: float = 0.0
    carrier: WeightCarrier = Field(default="grpc", description="how the weights arrived")
    fingerprint: str = Field(
        default="", max_length=128,
        description="the fingerprint of the weights now loaded (wire 2.7; weight_sync.fingerprint), which "
        "the controller compares with the published one; empty: not computed (CUDA IPC, an older worker)",
    )  # fmt: skip
    delta: bool = Field(default=False, description="loaded as a delta on the version it held")
