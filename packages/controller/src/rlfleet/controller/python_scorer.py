"""The run's reward tier when its reward is a Python callable: scored in the controller's own process.

A callable (``GRPOTrainer(reward=fn)``, ``trainer.set_reward_fn(lambda text: ...)``) lives only
in the process that made it. The wire never carries code (nothing is pickled) and the controller
never imports the reward package, so rather than shipping the function to a reward worker, the
run scores where the function is: while a Python reward is in force, the run's
:class:`~rlfleet.controller.reward_control.RewardControl` hands each chunk to a
:class:`PythonScorer` instead of sending ``reward.score`` on NATS::

    fleet.score ──► RewardControl.score ─┬─ a spec in force ──► reward.score (NATS) ──► reward worker
                                         └─ a Python reward ──► PythonScorer.score
                                              texts: TensorStore Get from the rollout worker's store
                                              fn: in a worker thread, one chunk at a time, under the
                                                  chunk's score deadline (controller/request_policy.py)
                                              ──► ScoreResult, as a reward worker replies

The reply is the message a reward worker gives (scores for every sample, version
``<python function NAME>-r<N>``), so the step's metrics (``reward/mean``, ``reward/std``...,
``reward/spec_revision``; with several functions, each one's mean as ``reward/<name>``), the
sample table and the regeneration of a chunk whose store is gone (a failed fetch names the chunk:
:mod:`rlfleet.controller.lost_chunks`) are those of any run. Only
the response and prompt texts travel to the controller, never tokens or logprobs. A run whose
reward starts as a callable starts no reward worker (switching to a spec later starts one:
``RewardControl.start_worker``).

The other design considered, a stand-in worker in the controller answering ``reward.score`` as a
member of the reward tier, gives the same scores but needs the reward role's NATS permissions and
a worker identity for a process that is not a worker; scoring in the process that holds the
function needs neither. A shared reward server never runs code sent to it: a callable aimed at
one is refused before anything is sent (``RewardControl.use_python``).

Faults: an exception of the function, a value that is not a finite number per response, or a
chunk still unscored at its deadline is a :class:`~rlfleet.controller.errors.RewardFnFailed` naming
the function (the step fails, the run stops every process it started and says why; the CLI exits
2). A function past its deadline cannot be stopped: it runs in a daemon thread of its own, left to
finish while the run stops, holding up neither the run's shutdown nor the process's exit. The
function never runs on two chunks at once, so it needs no locking of its own; while it runs, the
event loop goes on (heartbeats, the launcher's checks).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from rlfleet.common.control.messages import EndpointStats, GenerateResult, ScoreResult
from rlfleet.common.schema.batch import TEXT_FIELDS, unpack_texts
from rlfleet.common.schema.refs import TensorRef
from rlfleet.controller.errors import RewardFnFailed
from rlfleet.controller.python_reward import PythonReward
from rlfleet.controller.request_policy import Deadlines

logger = logging.getLogger(__name__)

TEXT_TENSORS = [*TEXT_FIELDS, "group_index"]
"""What is read of a chunk: its prompt and response texts and each sample's prompt."""


class TextSource(Protocol):
    """Where the texts come from: the run's :class:`~rlfleet.controller.own_store.OwnStore`."""

    async def fetch(self, ref: TensorRef, names: list[str] | None = None) -> dict[str, Any]: ...


class PythonScorer:
    """Scores rollout chunks with a :class:`PythonReward` in this process, and counts what it did."""

    def __init__(
        self, reward: PythonReward, endpoint: str, version: str, store: TextSource, deadlines: Deadlines
    ) -> None:
        self.reward = reward
        self.endpoint = endpoint
        self.version = version
        self.store = store
        self.deadlines = deadlines
        self.requests = self.samples = self.errors = 0
        self._total = 0.0
        self._lock = asyncio.Lock()  # one chunk at a time: the user's function needs no thread safety

    async def score(
        self, results: Sequence[GenerateResult], metadata: Sequence[Sequence[dict[str, Any]]],
        job_ids: Sequence[str],
    ) -> list[ScoreResult]:  # fmt: skip
        """Each chunk's :class:`ScoreResult`; ``metadata[i]`` is chunk i's per-prompt metadata."""
        return [await self._one(r, m, j) for r, m, j in zip(results, metadata, job_ids, strict=True)]

    async def _one(
        self, result: GenerateResult, metadata: Sequence[dict[str, Any]], job_id: str
    ) -> ScoreResult:
        got = await self.store.fetch(result.ref, TEXT_TENSORS)  # a TensorError names the chunk's store
        prompts = unpack_texts(got["prompt_text"], got["prompt_text_offsets"])
        responses = unpack_texts(got["response_text"], got["response_text_offsets"])
        groups = [int(g) for g in got["group_index"].tolist()]
        rows = [dict(metadata[g]) if g < len(metadata) else {} for g in groups]
        timeout = self.deadlines.score(result)
        self.requests += 1
        try:
            async with self._lock:
                scores, components = await asyncio.wait_for(
                    in_thread(self.reward.scored, prompts, responses, rows), timeout
                )
        except TimeoutError:
            self.errors += 1
            raise RewardFnFailed(
                self.reward.name, f"was still scoring {len(responses)} responses after {timeout:.0f} s (the "
                "chunk's score deadline; request_timeout_s sets one deadline for every request)",
            ) from None  # fmt: skip
        except RewardFnFailed:
            self.errors += 1
            raise
        self.samples += len(scores)
        self._total += sum(scores)
        return ScoreResult(job_id=job_id, endpoint=self.endpoint, spec_version=self.version, scores=scores,
                           components=components)  # fmt: skip

    def stats(self) -> EndpointStats:
        """What a reward worker would say of its endpoint: the reward, its version and its counts."""
        return EndpointStats(spec=self.reward.description, spec_version=self.version, requests=self.requests,
                             samples=self.samples, errors=self.errors,
                             raw_mean=self._total / self.samples if self.samples else 0.0)  # fmt: skip


async def in_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a thread of its own, awaited. A daemon thread, not the loop's executor: one
    the run gave up on (past its deadline) holds up neither the loop's shutdown nor the exit."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if done.done():  # given up on already
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)

    def run() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task as it is
            value, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            logger.debug("a reward function finished after its run's loop closed")

    owner = getattr(fn, "__self__", fn)  # a bound method (PythonReward.scored): its reward's name
    threading.Thread(target=run, name=f"reward-fn-{getattr(owner, 'name', 'python')}", daemon=True).start()
    return await done
