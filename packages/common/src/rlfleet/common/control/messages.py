"""Control-plane messages: every message any tier sends over NATS.

Each message is a pydantic model tagged by ``kind``; :data:`AnyMessage` is their discriminated
union and :func:`decode` is the one way to read bytes off the wire. Messages carry the wire schema
version in ``protocol`` ("MAJOR.MINOR"): another MAJOR is refused with :class:`ProtocolMismatch`,
a MINOR skew is accepted and unknown fields are ignored (:data:`PROTOCOL`, :func:`check_protocol`).
Bulk data never rides here: messages carry :class:`TensorRef` s to the gRPC tensor plane.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from rlfleet.common.errors import MessageDecodeError, MessageTooLarge, ProtocolMismatch
from rlfleet.common.schema.carriers import IpcBucket, WeightCarrier
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.trainer import ModelSettings, StepSettings
from rlfleet.common.schema.worker import Device

# --- the base every message shares: the wire schema version and its check -------------------

PROTOCOL = "2.0"
"""The wire schema version this code speaks: bump MINOR for additive changes, MAJOR otherwise."""

Tier = Literal["controller", "rollout", "reward", "trainer"]


class Message(BaseModel):
    """Base of every control message."""

    model_config = ConfigDict(extra="ignore", frozen=False)

    protocol: str = Field(default=PROTOCOL, description="wire schema version, MAJOR.MINOR")


MAX_MESSAGE_BYTES = 1 << 20
"""nats-server's default max_payload; a message over it belongs on the tensor plane."""


def _major(version: str) -> str:
    return version.split(".", 1)[0]


def check_protocol(theirs: object) -> None:
    """Raise :class:`ProtocolMismatch` unless ``theirs`` shares our MAJOR version."""
    if not isinstance(theirs, str) or not theirs:
        raise MessageDecodeError(f"'protocol' must be a 'MAJOR.MINOR' string, got {theirs!r}")
    if _major(theirs) != _major(PROTOCOL):
        raise ProtocolMismatch(PROTOCOL, theirs)


# --- membership -----------------------------------------------------------------------------


class WorkerAnnounce(Message):
    """A worker says it is up and what it offers."""

    kind: Literal["worker.announce"] = "worker.announce"
    tier: Tier
    worker_id: str
    subject: str = Field(default="", description="NATS subject for requests addressed to this worker alone")
    data_address: str = Field(default="", description="host:port of the worker's TensorStore, if any")
    capacity: int = Field(default=1, ge=1, description="how many jobs the worker takes at once")
    model_id: str = ""
    weight_version: int = -1
    pool: str = "default"
    pid: int = 0
    gpu_uuids: list[str] = Field(
        default_factory=list, max_length=64, description="GPUs the worker's model lives on (empty: CPU)"
    )


class Heartbeat(Message):
    """Periodic liveness from a worker."""

    kind: Literal["worker.heartbeat"] = "worker.heartbeat"
    tier: Tier
    worker_id: str
    weight_version: int = -1
    busy: int = Field(default=0, description="jobs in progress")
    pool: str = "default"


class WorkerLeave(Message):
    """A worker leaves on purpose (shutdown, drain)."""

    kind: Literal["worker.leave"] = "worker.leave"
    tier: Tier
    worker_id: str
    reason: str = ""


class Ping(Message):
    """Asks workers of a tier to announce themselves again (used by a controller that joins late)."""

    kind: Literal["worker.ping"] = "worker.ping"


# --- rollout --------------------------------------------------------------------------------


class SamplingParams(BaseModel):
    """How to sample: mirrors vLLM's SamplingParams for the fields rlfleet uses."""

    model_config = ConfigDict(extra="ignore")

    n: int = Field(default=1, ge=1, description="samples per prompt")
    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, description="-1 disables top-k")
    max_tokens: int = Field(default=64, ge=1, description="response length cap in tokens")
    stop_token_ids: list[int] = Field(default_factory=list, description="besides the model's EOS")
    seed: int | None = None
    logprobs: bool = True


class GenerateRequest(Message):
    """Generate ``n`` samples for each prompt at ``weight_version``."""

    kind: Literal["rollout.generate"] = "rollout.generate"
    job_id: str
    prompt_token_ids: list[list[int]]
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    weight_version: int = Field(default=-1, description="-1: whatever the worker holds")
    metadata: dict[str, Any] = Field(default_factory=dict)


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


class WeightsLoaded(Message):
    """A rollout worker now serves ``weight_version``."""

    kind: Literal["rollout.weights_loaded"] = "rollout.weights_loaded"
    worker_id: str
    weight_version: int
    seconds: float = 0.0
    carrier: WeightCarrier = Field(default="grpc", description="how the weights arrived")


# --- reward ---------------------------------------------------------------------------------


class ScoreRequest(Message):
    """Score a rollout batch with an endpoint's reward spec."""

    kind: Literal["reward.score"] = "reward.score"
    job_id: str
    endpoint: str = "default"
    rollout: TensorRef
    metadata: list[dict[str, Any]] = Field(
        default_factory=list, description="per prompt (group), e.g. answers"
    )
    token: str = Field(
        default="", description="protocol 1.1: the tenant token; now sent in the Rlfleet-Token header"
    )


class ScoreResult(Message):
    """Scores for every sample of a batch, and each component on its own."""

    kind: Literal["reward.result"] = "reward.result"
    job_id: str
    endpoint: str
    spec_version: str
    scores: list[float] = Field(description="(N,) the rewards: weighted total, then the endpoint's scaler")
    components: dict[str, list[float]] = Field(default_factory=dict)
    raw_scores: list[float] = Field(
        default_factory=list, description="(N,) weighted totals before the endpoint's scaler (empty: none)"
    )


class SetRewardSpec(Message):
    """Replace an endpoint's reward (hot swap): built in the background, then switched atomically.

    ``spec`` is the new spec (the spec syntax of rlfleet-reward, text or dict form); ``model_path``
    instead keeps the endpoint's spec and points its ``rm`` component (the one labelled
    ``component``, when several) at another reward-model directory. ``scaler`` (RewardScaler
    options) replaces the endpoint's scaler and ``scaler_state`` its running statistics; None keeps
    them. ``token`` is the tenant's token (or the server's admin token).
    """

    kind: Literal["reward.set_spec"] = "reward.set_spec"
    endpoint: str = "default"
    spec: str | dict[str, Any] | None = None
    token: str = Field(default="", description="protocol 1.1 only; now the Rlfleet-Token header")
    model_path: str | None = Field(default=None, description="new directory for the endpoint's rm component")
    component: str | None = Field(default=None, description="label of the rm component model_path replaces")
    scaler: dict[str, Any] | None = Field(default=None, description="RewardScaler options; {} = no scaling")
    scaler_state: dict[str, Any] | None = Field(default=None, description="RewardScaler.state_dict()")


class RewardSpecSet(Message):
    """An endpoint switched to a new spec."""

    kind: Literal["reward.spec_set"] = "reward.spec_set"
    endpoint: str
    spec_version: str
    previous_version: str = ""
    spec: str = Field(default="", description="the new spec in text form")
    load_s: float = Field(default=0.0, description="seconds spent building the new reward")


class RewardStatsRequest(Message):
    """Ask a reward worker for the statistics of the endpoints the token may see."""

    kind: Literal["reward.stats"] = "reward.stats"
    token: str = Field(default="", description="protocol 1.1 only; now the Rlfleet-Token header")
    endpoint: str = Field(default="", description="one endpoint; empty: every endpoint the token may see")


class EndpointStats(BaseModel):
    """What a reward worker knows about one endpoint."""

    model_config = ConfigDict(extra="ignore")

    spec: str
    spec_version: str
    requests: int = 0
    samples: int = 0
    errors: int = 0
    raw_mean: float = Field(default=0.0, description="mean weighted total (before scaling) of every sample")
    scaler: dict[str, Any] | None = None
    scaler_state: dict[str, Any] | None = None


class RewardStats(Message):
    """Per-endpoint statistics, limited to what the asking token may see."""

    kind: Literal["reward.stats_result"] = "reward.stats_result"
    worker_id: str
    tenant: str = Field(default="", description="the tenant the token belongs to ('admin' / '' when open)")
    endpoints: dict[str, EndpointStats] = Field(default_factory=dict)
    refused: dict[str, int] = Field(default_factory=dict, description="this tenant's refusals, by error code")


# --- trainer --------------------------------------------------------------------------------


class TrainerConfigure(Message):
    """The run's fixed trainer settings; a trainer whose own differ refuses the run, naming each field.

    Sent by the controller once the trainer has announced itself, before the first step.
    """

    kind: Literal["trainer.configure"] = "trainer.configure"
    model: ModelSettings
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


class TrainStepRequest(Message):
    """Run one policy update on rollout batches and their scores, with the step's settings."""

    kind: Literal["trainer.step"] = "trainer.step"
    step: int
    rollouts: list[TensorRef]
    scores: list[float]
    settings: StepSettings = Field(default_factory=StepSettings, description="how this step updates")


class TrainStepResult(Message):
    """Metrics of one update."""

    kind: Literal["trainer.step_result"] = "trainer.step_result"
    step: int
    metrics: dict[str, float]
    weight_version: int


class PublishWeights(Message):
    """Ask the trainer to push its current weights to the rollout workers."""

    kind: Literal["trainer.publish"] = "trainer.publish"
    weight_version: int = Field(default=-1, description="-1: next version")
    bucket_mb: float = 64.0
    carriers: list[WeightCarrier] = Field(
        default_factory=lambda: ["grpc"], min_length=1, max_length=2,
        description="how the rollout workers will load it (the controller picks one per worker)",
    )  # fmt: skip
    dtype: Literal["", "float32", "bfloat16", "float16"] = Field(
        default="", description="publish floating weights in this dtype (the engines'); empty: the trainer's"
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


# --- generic --------------------------------------------------------------------------------


class Ack(Message):
    """Plain acknowledgement."""

    kind: Literal["ack"] = "ack"
    detail: str = ""


class Shutdown(Message):
    """Ask a worker to stop after its current job."""

    kind: Literal["shutdown"] = "shutdown"
    reason: str = ""


class ErrorReply(Message):
    """A request failed: ``code`` is machine-readable, ``message`` is for people."""

    kind: Literal["error"] = "error"
    tier: str = ""
    code: str
    message: str
    retryable: bool = False


AnyMessage = Annotated[
    Union[  # noqa: UP007 - one name per line reads better than a 25-way `|` chain
        WorkerAnnounce, Heartbeat, WorkerLeave, Ping,
        GenerateRequest, GenerateResult, LoadWeights, WeightsLoaded,
        ScoreRequest, ScoreResult, SetRewardSpec, RewardSpecSet, RewardStatsRequest, RewardStats,
        TrainerConfigure, TrainerConfigured, TrainStepRequest, TrainStepResult,
        PublishWeights, WeightsPublished, LatestWeights,
        SaveCheckpoint, Saved, LoadCheckpoint, CheckpointLoaded,
        Ack, Shutdown, ErrorReply,
    ],
    Field(discriminator="kind"),
]  # fmt: skip
MESSAGES: TypeAdapter[AnyMessage] = TypeAdapter(AnyMessage)


def encode(message: Message, *, limit: int = MAX_MESSAGE_BYTES) -> bytes:
    """Serialize a message to JSON bytes, refusing ones over ``limit``."""
    data = message.model_dump_json().encode()
    if len(data) > limit:
        raise MessageTooLarge(len(data), limit, f"{getattr(message, 'kind', 'message')} message")
    return data


def decode(data: bytes | str) -> AnyMessage:
    """Read one message off the wire.

    Raises :class:`MessageDecodeError` for anything that is not a message of a known kind (including
    bytes that are not UTF-8, ``NaN``/``Infinity``, integers over Python's 4300-digit limit and
    nesting too deep to parse) and :class:`ProtocolMismatch` for a message of another MAJOR
    version; nothing else.
    """
    try:
        if isinstance(data, str):
            data = data.encode()
        raw = json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, TypeError, RecursionError) as exc:  # bad UTF-8 or JSON, a huge integer, too deep
        raise MessageDecodeError(f"not JSON ({exc.__class__.__name__}: {str(exc)[:120]})") from None
    if _SURROGATE_ESCAPE.search(data) and _has_lone_surrogate(raw):  # no reply could echo such a text
        raise MessageDecodeError("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), not Unicode text")
    if not isinstance(raw, dict):
        raise MessageDecodeError(f"expected a JSON object, got {type(raw).__name__}")
    check_protocol(raw.get("protocol"))
    try:
        return MESSAGES.validate_python(raw)
    except (ValidationError, RecursionError) as exc:
        raise MessageDecodeError(_summarize(exc)) from None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(raw: object) -> bool:
    """Whether any string (key or value) in ``raw`` cannot be written as UTF-8."""
    stack = [raw]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
    return False


def _finite(text: str) -> float:
    """A JSON number as a float, refusing one that overflows to infinity (``1e999``)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:40]} overflows a float")
    return value


def _no_constant(name: str) -> Any:
    """``NaN`` / ``Infinity`` are not JSON; no message carries them (our encoder writes null)."""
    raise ValueError(f"{name} is not a JSON value")


def _summarize(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
        return f"{where}: {first.get('msg', 'invalid')} ({exc.error_count()} error(s))"
    return exc.__class__.__name__
