"""Trainer messages: the run's fixed settings, a train step, publishing weights, checkpoints.

A step's metrics may be NaN or infinite (a step whose gradient norm overflowed: its update was
skipped, and the metric says why); :class:`TrainStepResult` writes them as the JSON strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, which read back as those floats. Every float a
request carries into the trainer is finite (its field refuses the others, naming the value).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from rlfleet.common.control.messages.base import SETTINGS_SET, Message
from rlfleet.common.schema.carriers import IpcBucket, WeightCarrier
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.trainer import LoraSettings, ModelSettings, StepSettings
from rlfleet.common.schema.worker import Device


class TrainerConfigure(Message):
    """The run's fixed trainer settings; a trainer whose own differ refuses the run, naming each field.

    Sent by the controller once the trainer has announced itself, before the first step.
    """

    kind: Literal["trainer.configure"] = "trainer.configure"
    model: Annotated[ModelSettings, SETTINGS_SET]
    device: Device
    critic: bool = Field(description="the run's algorithm trains a critic (the worker must hold one)")
    model_fingerprint: str = Field(
        default="", max_length=128, description="hash of the model's config.json; empty: not compared"
    )


class TrainerConfigured(Message):
    """A trainer accepted the run's settings."""

    kind: Literal["trainer.configured"] = "trainer.configured"
    worker_id: str
    weight_version: int
    incarnation: str = Field(default="", max_length=64, description="the answering trainer's incarnation")


GroupIndex = Annotated[int, Field(ge=0, lt=1 << 16)]
"""A group's index in its rollout chunk (the prompt it answers)."""

FiniteScore = Annotated[float, Field(allow_inf_nan=False)]
"""A rollout's score: a finite float (a NaN or infinite score would poison the advantages)."""


class TrainStepRequest(Message):
    """Run one policy update on rollout batches and their scores, with the step's settings."""

    kind: Literal["trainer.step"] = "trainer.step"
    step: int = Field(ge=0)
    rollouts: list[TensorRef] = Field(max_length=4096, description="the batch's chunks, one per rollout job")
    scores: list[FiniteScore] = Field(max_length=1 << 20, description="one finite score per rollout sample")
    settings: Annotated[StepSettings, SETTINGS_SET] = Field(
        default_factory=StepSettings,
        description="how this step updates (only its non-default settings travel)",
    )
    job_id: str = Field(
        default="", max_length=128, description="idempotency key: a retry with this id gets the first answer"
    )
    groups: list[Annotated[list[GroupIndex], Field(max_length=1 << 16)]] | None = Field(
        default=None, max_length=4096,
        description="dynamic sampling (wire 2.7): per rollout chunk, one list of the groups (its prompts, "
        "ascending) the step trains on, and ``scores`` covers only their samples; None: every group of "
        "every chunk",
    )  # fmt: skip


class TrainStepResult(Message):
    """Metrics of one update; non-finite ones travel as ``"NaN"``/``"Infinity"`` strings (see above)."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    kind: Literal["trainer.step_result"] = "trainer.step_result"
    step: int
    metrics: dict[str, float]
    weight_version: int
    incarnation: str = Field(default="", max_length=64, description="the answering trainer's incarnation")


class PublishWeights(Message):
    """Ask the trainer to push its current weights to the rollout workers."""

    kind: Literal["trainer.publish"] = "trainer.publish"
    weight_version: int = Field(default=-1, description="-1: next version")
    bucket_mb: float = 64.0
    carriers: list[WeightCarrier] = Field(
        default=["grpc"], min_length=1, max_length=2,  # a list default: pydantic copies it per message
        description="how the rollout workers will load it (the controller picks one per worker)",
    )  # fmt: skip
    dtype: Literal["", "float32", "bfloat16", "float16"] = Field(
        default="", description="publish floating weights in this dtype (the engines'); empty: the trainer's"
    )
    job_id: str = Field(
        default="", max_length=128, description="idempotency key: a retry with this id gets the first answer"
    )
    delta: bool = Field(
        default=False,
        description="also stage the change from the version before, for workers that hold it (wire 2.7; "
        "over gRPC; the trainer stages the whole version anyway)",
    )
    adapter: bool = Field(
        default=False,
        description="a LoRA trainer publishes its adapter alone (wire 2.8; over gRPC, no delta), which the "
        "engines apply to the base they hold; false, or a trainer without LoRA: the whole weights",
    )


class WeightsPublished(Message):
    """The trainer has staged a weight version and every rollout worker loaded it."""

    kind: Literal["trainer.published"] = "trainer.published"
    weight_version: int
    buckets: list[TensorRef]
    nbytes: int
    seconds: float
    loaded_by: list[str] = Field(default_factory=list)
    ipc_buckets: list[IpcBucket] = Field(
        default_factory=list, description="the version's buckets shared by CUDA IPC, when asked for"
    )
    incarnation: str = Field(default="", max_length=64, description="the answering trainer's incarnation")
    fingerprint: str = Field(
        default="", max_length=128,
        description="the version's fingerprint (wire 2.7; rlfleet.common.tensors.weight_sync), which every "
        "worker's WeightsLoaded must match; empty: not computed (a CUDA IPC only publish, an older trainer)",
    )  # fmt: skip
    delta_buckets: list[TensorRef] = Field(
        default_factory=list, description="the change from version delta_from, when asked for and possible"
    )
    delta_from: int = Field(default=-1, ge=-1, description="the version delta_buckets apply to; -1: none")
    delta_nbytes: int = Field(default=0, ge=0, description="bytes of delta_buckets")
    adapter: LoraSettings | None = Field(
        default=None,
        description="the buckets hold a LoRA adapter of these settings under PEFT's names (wire 2.8), which "
        "the engines apply to the base model they hold; None: the whole weights",
    )


class LatestWeights(Message):
    """Ask the trainer for its current weight version (a late rollout worker catching up).

    The reply is the :class:`WeightsPublished` of that version (``buckets`` empty before the
    first publish: the model on disk is version 0).
    """

    kind: Literal["trainer.latest"] = "trainer.latest"
    worker_id: str = ""


class SaveCheckpoint(Message):
    """Ask the trainer to save a checkpoint to a path.

    ``mode="hf"``: an HF-format export in ``path``. ``mode="full"``: the HF export in ``path/hf``
    plus the training state (sharded model and optimizer, schedulers, RNG) in ``path/trainer``.
    """

    kind: Literal["trainer.save"] = "trainer.save"
    path: str
    mode: Literal["hf", "full"] = "hf"


class Saved(Message):
    """A checkpoint was written."""

    kind: Literal["trainer.saved"] = "trainer.saved"
    path: str
    incarnation: str = Field(default="", max_length=64, description="the answering trainer's incarnation")


class LoadCheckpoint(Message):
    """Ask the trainer to restore the training state a full save wrote in ``path`` (its ``trainer/``).

    ``weight_version`` is the version the restored weights had; the next publish continues from it.
    """

    kind: Literal["trainer.load"] = "trainer.load"
    path: str
    weight_version: int = Field(default=0, ge=0)


class CheckpointLoaded(Message):
    """The trainer restored a checkpoint: its optimizer step count and weight version now."""

    kind: Literal["trainer.loaded"] = "trainer.loaded"
    path: str
    steps: int
    weight_version: int
    incarnation: str = Field(default="", max_length=64, description="the answering trainer's incarnation")
