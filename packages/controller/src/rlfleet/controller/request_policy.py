"""How the controller asks a tier: each request's deadline, from the work it carries, and one retry policy.

**Deadlines** (issue 12, point 6). A fixed deadline is wrong both ways: 900 s lets a wedged tiny
step hang for a quarter of an hour, and a large step on slow hardware can need longer.
:class:`Deadlines` gives every request a deadline of three parts::

    deadline = outage allowance + fixed floor + work x bound per unit of work   (x deadline_scale)

- the **outage allowance** is ``faults.outage_grace_s`` (120 s): the NATS transport waits out a lost
  connection that long (and then sends the request again) within the request's own deadline;
- the **floor** (:data:`FLOOR_S`) covers delivery, a worker finishing the one job ahead of it, and
  a call's start-up;
- the **work** is counted from the request itself, with a bound per unit (below) chosen for two slow,
  shared CPU cores, about ten times what they need (the SmolLM2-135M example, 32 samples of 96
  tokens, generates in about 5 ms per sample-token and trains in about 3 ms per token), and a
  smaller one when the worker announced GPUs.

=============  ==========================================  ==========================  ==========
request        work                                        CPU bound                   GPU bound
=============  ==========================================  ==========================  ==========
generate       samples x (new tokens + prompt tokens / 10)  50 ms per sample-token      2 ms
score          samples, and generated tokens               0.5 s/sample + 10 ms/token  (same)
train step     batch tokens (batch bytes / 16)             50 ms per token             2 ms
publish        model bytes (the last publish's)            64 MiB/s                    (same)
load weights   the version's bytes                         16 MiB/s                    (same)
save / load    model bytes (x4 for a full checkpoint)      32 MiB/s                    (same)
reward swap    a reward model may load                     +300 s                      (same)
=============  ==========================================  ==========================  ==========

Before the first publish the model's size is not known and :data:`UNKNOWN_MODEL_BYTES` (16 GiB,
an 8B model in bf16) stands for it. No scaled deadline exceeds :data:`MAX_S` (6 h). Raise
``faults.deadline_scale`` for slower hardware; ``request_timeout_s`` set in the job gives every
request that one deadline instead (the old behaviour). A stall shorter than any deadline is still
reported within ``faults.stall_report_s`` by the watchdog.

**Retries** (issue 12, point 1; :func:`with_retries`, the last section): a reward server answering
``QuotaExceeded``, a peer restarting, or a request nobody answered in time should cost a retry, not
the run. Only errors that can pass are retried: a ``RemoteError`` marked ``retryable``, a
``RequestTimeout`` or ``NoResponders`` (the peer may come back), a tensor store that is busy or
unavailable; everything else is raised at once. The wait doubles from ``retry_backoff_s`` up to
``retry_backoff_max_s``; an error's ``retry_after_s`` (seconds the peer asked us to wait) wins when
it is longer. When ``retry_attempts`` tries are spent the last error is wrapped in
:class:`RetriesExhausted` naming what was tried. The caller keeps one ``job_id`` across the tries,
so a trainer that already did the work answers the repeat from its cache instead of stepping twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from rlfleet.common.control.messages import GenerateRequest, GenerateResult, LoadWeights
from rlfleet.common.errors import (
    NoResponders,
    RemoteError,
    RequestTimeout,
    TensorStoreBusy,
    TensorStoreUnavailable,
)
from rlfleet.common.schema.refs import TensorRef
from rlfleet.controller.errors import RetriesExhausted
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.watchdog import MAX_EXTENSIONS

FLOOR_S = 30.0
"""Fixed part of every deadline: delivery, the one job queued ahead, a call's start-up."""

MAX_S = 6 * 3600.0
"""No scaled deadline is longer (a request of absurd size still ends with a named timeout)."""

GENERATE_TOKEN_S = {"cpu": 0.05, "gpu": 0.002}
"""Seconds per sample per new token (a prompt token counts a tenth: prefill is batched)."""

PREFILL_SHARE = 0.1
"""What one prompt token costs relative to one generated token."""

SCORE_SAMPLE_S = 0.5
"""Seconds per scored sample (a rule reward takes microseconds; a reward model or a remote judge more)."""

SCORE_TOKEN_S = 0.01
"""Seconds per generated token scored (a reward model's forward pass on CPU)."""

TRAIN_TOKEN_S = {"cpu": 0.05, "gpu": 0.002}
"""Seconds per batch token of one update (policy forward and backward, reference and critic)."""

TRAIN_BYTES_PER_TOKEN = 16
"""Batch bytes per token: a token's id and mask are two int64 (logprobs and texts add more, so the
count is an overestimate, which only lengthens the deadline)."""

PUBLISH_BYTES_S = 64 * 2**20
"""The trainer gathering and staging its weights in its own store (memory, not network)."""

LOAD_BYTES_S = 16 * 2**20
"""A rollout worker streaming a version from the trainer's store over gRPC and loading it."""

CHECKPOINT_BYTES_S = 32 * 2**20
"""A trainer writing or reading a checkpoint on disk."""

FULL_CHECKPOINT_FACTOR = 4
"""A full checkpoint is the weights plus the optimizer state (Adam: two moments, fp32)."""

MODEL_LOAD_S = 300.0
"""A reward swap may load a reward model (from disk, on CPU)."""

UNKNOWN_MODEL_BYTES = 16 * 2**30
"""Model size assumed before the first publish tells it."""

UNKNOWN_TRAIN_S = 900.0
"""Work assumed for a train step whose batch refs carry no byte count (the old fixed deadline)."""


def device_of(gpu_uuids: Sequence[str]) -> str:
    """``gpu`` when a worker announced GPUs, else ``cpu``."""
    return "gpu" if gpu_uuids else "cpu"


POOL_POLL_S = 0.2
"""How often work waiting on an empty pool looks for a worker (an announce lands in the registry)."""


def give_up_at(timeout: float) -> float:
    """The wall-clock time (UNIX seconds) a request sent now with ``timeout`` carries as its
    ``deadline``: the longest the controller waits on that try (the watchdog grants a busy worker the
    timeout again up to :data:`MAX_EXTENSIONS` times). Past it the worker stops the work that nobody
    waits for any more (issue 29, point 5)."""
    return time.time() + timeout * (1 + MAX_EXTENSIONS)


@dataclass
class Deadlines:
    """Each request's deadline in seconds, from its work (see the module docstring).

    ``override`` (``TrainerConfig.request_timeout_s``) replaces every one when set; ``faults``
    gives the outage allowance and ``deadline_scale``. ``model_bytes`` is learned from the last
    publish (:meth:`published`).
    """

    override: float | None = None
    faults: FaultSettings = field(default_factory=FaultSettings)
    model_bytes: int = 0

    def __post_init__(self) -> None:
        if self.override is not None and not self.override > 0:
            raise ValueError(
                f"request_timeout_s must be > 0 s (unset: scaled to the work), got {self.override}"
            )

    def _of(self, work_s: float) -> float:
        if self.override is not None:
            return self.override
        scaled = (self.faults.outage_grace_s + FLOOR_S + max(0.0, work_s)) * self.faults.deadline_scale
        return min(MAX_S, scaled)

    @property
    def _model_bytes(self) -> int:
        return self.model_bytes or UNKNOWN_MODEL_BYTES

    def published(self, nbytes: int) -> None:
        """Remember the model's size from a publish (later publishes, loads and saves scale with it)."""
        if nbytes > 0:
            self.model_bytes = nbytes

    def control(self) -> float:
        """A request with no work of its own (configure, statistics)."""
        return self._of(0.0)

    def generate(self, request: GenerateRequest, gpu_uuids: Sequence[str] = ()) -> float:
        """A generate job: its samples times (new tokens + a tenth of the prompt), at the worker's bound."""
        sampling = request.sampling
        prompts = request.prompt_token_ids
        tokens = sampling.n * (len(prompts) * sampling.max_tokens + PREFILL_SHARE * sum(map(len, prompts)))
        return self._of(tokens * GENERATE_TOKEN_S[device_of(gpu_uuids)])

    def score(self, result: GenerateResult) -> float:
        """Scoring one rollout chunk: its samples and generated tokens."""
        return self._of(result.num_samples * SCORE_SAMPLE_S + result.num_tokens * SCORE_TOKEN_S)

    def train_step(self, rollouts: Sequence[TensorRef], gpu_uuids: Sequence[str] = ()) -> float:
        """One update on the referenced batches: their tokens, counted from their bytes."""
        nbytes = sum(ref.nbytes for ref in rollouts)
        if nbytes <= 0:  # a store that did not say how big the batch is
            return self._of(UNKNOWN_TRAIN_S)
        return self._of(nbytes / TRAIN_BYTES_PER_TOKEN * TRAIN_TOKEN_S[device_of(gpu_uuids)])

    def publish(self) -> float:
        """The trainer staging a weight version: the model's bytes."""
        return self._of(self._model_bytes / PUBLISH_BYTES_S)

    def load_weights(self, message: LoadWeights) -> float:
        """A rollout worker loading a version: its buckets' bytes (IPC buckets count as local)."""
        nbytes = sum(ref.nbytes for ref in message.buckets) or self._model_bytes
        return self._of(nbytes / LOAD_BYTES_S)

    def checkpoint(self, full: bool) -> float:
        """A trainer saving or restoring: the weights, and for a full checkpoint its optimizer state."""
        factor = FULL_CHECKPOINT_FACTOR if full else 1
        return self._of(self._model_bytes * factor / CHECKPOINT_BYTES_S)

    def reward_swap(self) -> float:
        """A reward hot swap, which may load a reward model."""
        return self._of(MODEL_LOAD_S)


# --- one retry policy for score, train-step, publish and weight-load requests ------------------------

T = TypeVar("T")
log = logging.getLogger(__name__)

TRANSIENT = (RequestTimeout, NoResponders, TensorStoreBusy, TensorStoreUnavailable)


def is_retryable(exc: BaseException) -> bool:
    """Whether trying ``exc``'s request again can succeed."""
    if isinstance(exc, RemoteError):
        return bool(exc.retryable)
    return isinstance(exc, TRANSIENT) or getattr(exc, "retryable", False) is True


def backoff_s(settings: FaultSettings, attempt: int, exc: BaseException | None = None) -> float:
    """Seconds to wait after failed try number ``attempt`` (1-based): doubling, capped, at least
    the ``retry_after_s`` the error carries (a peer's own request to wait; never negative)."""
    wait = min(settings.retry_backoff_s * 2 ** (attempt - 1), settings.retry_backoff_max_s)
    after = getattr(exc, "retry_after_s", None)
    if isinstance(after, (int, float)) and after > wait:
        wait = min(float(after), 3600.0)
    return wait


async def with_retries(
    what: str, attempt: Callable[[], Awaitable[T]], settings: FaultSettings,
    *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    retry_if: Callable[[BaseException], bool] = is_retryable,
) -> T:  # fmt: skip
    """``await attempt()`` until it succeeds, retrying retryable errors within the budget.

    Raises the first non-retryable error as it is, and :class:`RetriesExhausted` (``what``, the
    number of tries, the last error) when ``settings.retry_attempts`` tries all failed retryably.
    ``retry_if`` narrows what counts as retryable for one kind of request.
    """
    for n in range(1, settings.retry_attempts + 1):
        try:
            return await attempt()
        except Exception as exc:
            if not retry_if(exc):
                raise
            if n == settings.retry_attempts:
                raise RetriesExhausted(what, n, exc) from exc
            wait = backoff_s(settings, n, exc)
            log.warning(
                "%s: try %d of %d failed (%s); retrying in %.1f s",
                what,
                n,
                settings.retry_attempts,
                exc,
                wait,
            )
            await sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover
