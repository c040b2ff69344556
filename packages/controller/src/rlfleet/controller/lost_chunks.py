"""No batch lives in one place only (issue 12, point 2): a rollout chunk whose producing worker is
gone before the reward and trainer tiers fetched it is generated again.

A rollout worker keeps each chunk it generates in its own TensorStore; the controller hands the
chunk's ref to the reward tier (scores) and to the trainer (the update). A worker that dies after
answering leaves a ref to a store nobody serves. So the fleet records what each chunk was asked
for (:class:`ChunkOrder`: its prompts, its sampling with the step's seed, the weight version, the
pool, and which process answered), and :class:`StepChunks` carries one step's chunks through
scoring and training:

- before scoring and before training it looks for chunks whose producer is gone: the registry
  saw it leave or declared it dead, or it came back as another process (a new, empty store);
- a score or train request that fails on a chunk (the error names the chunk's store or key, or
  is retryable while the chunk's producer is gone) marks that chunk lost;

and generates each lost chunk again on a live worker (never the process that lost it) at the
same weight version, with the same prompts and sampling seed, scores the new chunk, and puts it
in the lost one's place. The step's chunks stay in prompt order, one result per chunk, so every
prompt is answered exactly once: none twice, none missing. A chunk is generated again at most
``faults.retry_attempts`` times, each within that retry budget; when its pool has no other live
worker (a lone worker restarted by its launcher is still coming back) the fleet waits for one, up
to ``faults.empty_pool_wait_s`` (:meth:`rlfleet.controller.fleet.Fleet.pool_back`: the one place
that wait lives). Past either the step fails with
:class:`~rlfleet.controller.errors.ChunkNotRegenerated`, naming the chunk and its lost worker.

Scoring streams (issue 30): the step makes its :class:`StepChunks` before anything is generated,
and each chunk is sent to the reward tier as soon as its worker returns it (:meth:`StepChunks.arrived`,
told by :meth:`~rlfleet.controller.ports.FleetClient.generate`), while the others still generate.
That is the chunk's first scoring round, judged like any other once the step's chunks are placed
in prompt order: a chunk whose producer is already gone when it arrives is not scored then but made
again, a score that fails on a lost chunk makes it again, and any other failure fails the step.
Nothing of what is trained depends on when a chunk came.

Why regenerate rather than copy every chunk into the controller's store: the bulk data keeps
going from the tier that made it to the tiers that use it (the controller never carries a
batch, :mod:`rlfleet.controller.fleet`), and a lost chunk costs one chunk's generation, only
when a worker dies. A train request is never abandoned: a fetch fails before the trainer
updates anything, and a retry of its job id is answered from the trainer's cache, so the new
train request (new refs, new job id) never doubles an update.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from rlfleet.common.control.messages import GenerateResult, ScoreResult, TrainStepResult
from rlfleet.common.errors import RemoteError, TensorError
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.trainer import StepSettings
from rlfleet.controller.errors import ChunkNotRegenerated, NoWorkerServed, RetriesExhausted
from rlfleet.controller.ports import ChunkOrder as ChunkOrder  # re-exported: the fleet records them
from rlfleet.controller.ports import ChunkOrderBook, FleetClient
from rlfleet.controller.request_policy import is_retryable, with_retries

logger = logging.getLogger(__name__)

MAX_ORDERS = 256
"""Chunk orders a fleet remembers (a step forgets its own when it ends; this bounds the rest)."""

FETCH_CODES = frozenset({"unavailable", "timeout", "internal"})
"""Error codes of a tier that could not fetch a chunk (unreachable store, stalled stream, unknown key)."""


def group_scores(result: GenerateResult, scored: ScoreResult, prompt: int) -> list[float]:
    """The scores of chunk ``result``'s samples of its prompt ``prompt`` (prompt-major rows)."""
    n = result.num_samples // max(result.num_prompts, 1)
    return list(scored.scores[prompt * n : (prompt + 1) * n])


def _key(ref: TensorRef) -> str:
    return f"{ref.address}/{ref.key}"


class ChunkOrders:
    """The order (:class:`~rlfleet.controller.ports.ChunkOrder`) of each chunk a fleet generated, by
    its result's ref (the oldest forgotten past :data:`MAX_ORDERS`)."""

    def __init__(self) -> None:
        self._orders: OrderedDict[str, ChunkOrder] = OrderedDict()

    def record(self, result: GenerateResult, order: ChunkOrder) -> None:
        self._orders[_key(result.ref)] = order
        while len(self._orders) > MAX_ORDERS:
            self._orders.popitem(last=False)

    def get(self, result: GenerateResult) -> ChunkOrder | None:
        return self._orders.get(_key(result.ref))

    def forget(self, results: Sequence[GenerateResult]) -> None:
        for result in results:
            self._orders.pop(_key(result.ref), None)

    def __len__(self) -> int:
        return len(self._orders)


def root_cause(exc: BaseException) -> BaseException:
    """The error under a spent retry budget (:class:`RetriesExhausted`), else ``exc``."""
    while isinstance(exc, RetriesExhausted):
        exc = exc.last
    return exc


def names_chunk(exc: BaseException, ref: TensorRef) -> bool:
    """Whether ``exc`` is a tier's failure to fetch ``ref``: its message names the chunk's store
    address or key (whole: port ``5000`` is not ``50001``), with a fetch-failure code."""
    cause = root_cause(exc)
    if isinstance(cause, RemoteError):
        if cause.code not in FETCH_CODES:
            return False
    elif not isinstance(cause, TensorError):
        return False
    text = str(cause)
    address = bool(ref.address) and re.search(re.escape(ref.address) + r"(?![0-9])", text) is not None
    return address or (bool(ref.key) and re.search(re.escape(ref.key) + r"(?![\w/-])", text) is not None)


def producer_gone(fleet: FleetClient, order: ChunkOrder) -> bool:
    """Whether the process that answered ``order`` is gone: left, declared dead, or replaced by a
    new process under its id (whose store never held the chunk)."""
    info = fleet.registry.get("rollout", order.worker_id)
    if info is None or fleet.is_gone(order.worker_id):
        return True
    return info.announce.incarnation != order.incarnation


class StepChunks:
    """One step's rollout chunks (``results[i]`` answers the next ``num_prompts`` prompts, with
    ``metadata[i]`` their metadata), scored and trained on by ``fleet``, each lost one generated again.

    Streaming: made before generation (with no results), it is told of each chunk as it arrives
    (:meth:`arrived`) and starts scoring it at once, while the other chunks are still generating;
    :meth:`place` then sets the step's chunks in prompt order, and :meth:`score` finishes what
    arrival began. Made with every result (nothing arrives), :meth:`score` scores them all: the
    same rounds, so a chunk's score, its place and its regeneration do not depend on when it came.
    """

    def __init__(
        self, fleet: FleetClient, results: Sequence[GenerateResult],
        metadata: Sequence[Sequence[dict[str, Any]]], endpoint: str,
    ) -> None:  # fmt: skip
        self.fleet = fleet
        self.orders: ChunkOrderBook | None = getattr(fleet, "orders", None)  # none: nothing is regenerated
        self.endpoint = endpoint
        self.regenerated = 0
        """Chunks generated again in this step."""
        self.spans: list[list[float]] = []
        """Each scoring begun on arrival: ``[start, end]`` in ``time.perf_counter`` (end ``inf``: running)."""
        self._losses: dict[int, int] = {}  # chunk index -> times it was lost
        self._arrived: dict[str, asyncio.Task[ScoreResult]] = {}  # chunk ref -> scoring begun on arrival
        self._streamed: dict[int, asyncio.Task[ScoreResult]] = {}  # chunk index -> scoring begun on arrival
        self._closed = False
        self.results: list[GenerateResult] = []
        self.metadata: list[list[dict[str, Any]]] = []
        self.scored: list[ScoreResult | None] = []
        self.place(results, metadata)

    def _order(self, i: int) -> ChunkOrder | None:
        return self.orders.get(self.results[i]) if self.orders is not None else None

    def gone(self) -> list[int]:
        """Chunks whose producer is gone (a fn-written chunk lives in the controller's store: never)."""
        return [i for i in range(len(self.results)) if (o := self._order(i)) and producer_gone(self.fleet, o)]

    def lost_by(self, i: int, exc: BaseException) -> bool:
        """Whether chunk ``i`` is lost, as the failed request ``exc`` tells."""
        order = self._order(i)
        if order is None:
            return False
        if names_chunk(exc, self.results[i].ref):
            return True
        return is_retryable(root_cause(exc)) and producer_gone(self.fleet, order)

    # --- streaming: a chunk scored as it arrives ------------------------------------------------

    def arrived(self, result: GenerateResult, metadata: Sequence[dict[str, Any]]) -> None:
        """Chunk ``result`` (its prompts' ``metadata``) was generated: score it now, while the rest
        generate. A chunk whose producer is already gone waits for :meth:`score` (made again there)."""
        order = self.orders.get(result) if self.orders is not None else None
        key = _key(result.ref)
        if self._closed or key in self._arrived or (order is not None and producer_gone(self.fleet, order)):
            return
        span = [time.perf_counter(), math.inf]
        self.spans.append(span)

        async def scoring() -> ScoreResult:
            try:
                return await self._score_chunk(result, list(metadata))
            finally:
                span[1] = time.perf_counter()

        self._arrived[key] = asyncio.create_task(scoring(), name=f"score-{result.job_id}")

    def place(self, results: Sequence[GenerateResult], metadata: Sequence[Sequence[dict[str, Any]]]) -> None:
        """The step's chunks in prompt order (every arrived one among them), once generation is done."""
        self.results = list(results)
        self.metadata = [list(m) for m in metadata]
        self.scored = [None] * len(self.results)
        for i, result in enumerate(self.results):
            if (task := self._arrived.pop(_key(result.ref), None)) is not None:
                self._streamed[i] = task
        assert not self._arrived, "every chunk told of is one of the step's"

    def overlap(self, start: float, end: float) -> float:
        """Seconds within ``[start, end]`` (generation) while at least one chunk was being scored."""
        covered, reach = 0.0, start
        for lo, hi in sorted((max(lo, start), min(hi, end)) for lo, hi in self.spans):
            if hi > max(lo, reach):
                covered += hi - max(lo, reach)
                reach = hi
        return covered

    async def abandon(self) -> None:
        """Stop the scoring begun on arrival (the step failed before its chunks were placed)."""
        self._closed = True
        tasks = [*self._arrived.values(), *self._streamed.values()]
        self._arrived, self._streamed = {}, {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- scoring ---------------------------------------------------------------------------------

    async def score(self) -> list[ScoreResult]:
        """Every chunk's score, in chunk order; a chunk lost before or while it is scored is
        generated again and the new one scored (the scoring begun on arrival counts as the first round)."""
        streamed, self._streamed = self._streamed, {}
        if streamed:
            pending = sorted(streamed)
            await self._settle(pending, await asyncio.gather(*(streamed[i] for i in pending),
                                                             return_exceptions=True))  # fmt: skip
        while True:  # a round scores what is left or replaces a chunk (each lost a bounded number of times)
            await self._replace(self.gone(), None)
            pending = [i for i, s in enumerate(self.scored) if s is None]
            if not pending:
                return [s for s in self.scored if s is not None]
            outcomes = await asyncio.gather(*(self._score_one(i) for i in pending), return_exceptions=True)
            await self._settle(pending, outcomes)

    async def _settle(self, pending: list[int], outcomes: Sequence[ScoreResult | BaseException]) -> None:
        """Keep each scored chunk; generate the lost ones again; raise any other failure."""
        lost: list[int] = []
        cause: BaseException | None = None
        for i, outcome in zip(pending, outcomes, strict=True):
            if isinstance(outcome, ScoreResult):
                self.scored[i] = outcome
            elif isinstance(outcome, Exception) and self.lost_by(i, outcome):
                lost.append(i)
                cause = outcome
            else:
                raise outcome
        await self._replace(lost, cause)

    async def _score_one(self, i: int) -> ScoreResult:
        return await self._score_chunk(self.results[i], self.metadata[i])

    async def _score_chunk(self, result: GenerateResult, metadata: list[dict[str, Any]]) -> ScoreResult:
        [scored] = await self.fleet.score([result], [metadata], self.endpoint)
        return scored

    def extend(self, other: StepChunks) -> None:
        """Take ``other``'s chunks (placed, their scoring begun or done) after this step's own: the
        batches a step generated more of (dynamic sampling), trained and released as one."""
        base = len(self.results)
        self.results += other.results
        self.metadata += other.metadata
        self.scored += other.scored
        self._streamed.update({base + i: task for i, task in other._streamed.items()})
        self._losses.update({base + i: n for i, n in other._losses.items()})
        self.regenerated += other.regenerated
        other.results, other.metadata, other.scored, other._streamed = [], [], [], {}

    async def train(
        self, step: int, settings: StepSettings,
        choose: Callable[[Sequence[ScoreResult]], list[list[int]]] | None = None,
    ) -> TrainStepResult:  # fmt: skip
        """The step's update on every chunk, or (``choose``: per chunk, the groups to train on, from
        the scores) on the groups chosen; a chunk the trainer could not fetch (or whose producer went
        before it was sent) is generated again and scored, the choice made again, and the update
        asked for again."""
        while True:
            scored = await self.score()
            refs = [r.ref for r in self.results]
            scores = [s for result in scored for s in result.scores]
            kept: dict[str, Any] = {}
            if choose is not None:
                groups = choose(scored)
                picked = [i for i, chunk_groups in enumerate(groups) if chunk_groups]
                refs = [self.results[i].ref for i in picked]
                scores = [s for i in picked for p in groups[i]
                          for s in group_scores(self.results[i], scored[i], p)]  # fmt: skip
                kept = {"groups": [groups[i] for i in picked]}
            try:
                return await self.fleet.train_step(step, refs, scores, settings, **kept)
            except Exception as exc:
                lost = [i for i in range(len(self.results)) if self.lost_by(i, exc)]
                if not lost:
                    raise
                await self._replace(lost, exc)

    async def _replace(self, lost: list[int], cause: BaseException | None) -> None:
        if lost:
            await asyncio.gather(*(self._regenerate(i, cause) for i in lost))

    async def _regenerate(self, i: int, cause: BaseException | None) -> None:
        """Generate chunk ``i`` again and put it in place (unscored); raise past the budget."""
        old, order = self.results[i], self._order(i)
        assert order is not None, "only chunks with an order are lost"
        faults = self.fleet.faults
        self._losses[i] = losses = self._losses.get(i, 0) + 1
        why = f"{cause}" if cause is not None else "its worker is gone"
        if losses > faults.retry_attempts:
            raise ChunkNotRegenerated(old.job_id, order.worker_id, old.num_prompts, losses - 1,
                                      cause or NoWorkerServed("lost again"))  # fmt: skip
        logger.warning("rollout chunk %s (%d prompts) of worker %s is lost (%s); generating it again on "
                       "a live worker", old.job_id, old.num_prompts, order.worker_id, why)  # fmt: skip
        try:  # the fleet waits for an empty pool itself: a NoWorkerServed from it is final
            new = await with_retries(
                f"generating rollout chunk {old.job_id} again", lambda: self.fleet.regenerate(order), faults
            )
        except (RetriesExhausted, NoWorkerServed) as exc:
            last = root_cause(exc)
            attempts = exc.attempts if isinstance(exc, RetriesExhausted) else 1
            raise ChunkNotRegenerated(old.job_id, order.worker_id, old.num_prompts, attempts, last) from exc
        if new.num_prompts != old.num_prompts:
            wrong = ValueError(f"{new.worker_id} answered {new.num_prompts} prompts of {old.num_prompts}")
            raise ChunkNotRegenerated(old.job_id, order.worker_id, old.num_prompts, 1, wrong)
        logger.warning("rollout chunk %s generated again by worker %s as %s", old.job_id, new.worker_id,
                       new.job_id)  # fmt: skip
        self.results[i], self.scored[i] = new, None
        if self.orders is not None:
            self.orders.forget([old])
        self.regenerated += 1

    def forget(self) -> None:
        """Drop the orders of the step's chunks (the step is done with them)."""
        if self.orders is not None:
            self.orders.forget(self.results)
