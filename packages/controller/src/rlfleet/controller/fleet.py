"""The controller's handle on the tiers: every call is a control message; bulk data stays put.

``Fleet`` knows the workers through the membership registry and speaks to them over the
transport. It never fetches rollout tensors or weights: it hands :class:`TensorRef` s from the
tier that produced them to the tier that consumes them.

::

    generate ──► rollout workers ──(refs)──► score ──► reward tier ──(scores)──┐
        ▲                         └─────────(refs)──────────────────────────► train_step ──► trainer
        └──── load_weights(bucket refs) ◄── publish ◄─────────────────────────────────────────┘

Prompts are split over the rollout fleet by capacity (:func:`split_by_capacity`); each chunk is told
of as soon as it is generated (``on_chunk``: the step scores it while the rest generate); a request
to a worker that goes is abandoned at once (:class:`GoneWatch`); a chunk whose producer is gone
before the reward and trainer tiers fetched it is generated again
(:mod:`rlfleet.controller.lost_chunks`). :func:`publish` moves a run to the trainer's next weights.
``Fleet`` is the run's :class:`~rlfleet.controller.ports.FleetClient`.

**A pool momentarily empty** (issue 29). When the only worker of a pool dies, leaves or is
declared dead while it holds the pool's work, the pool has nobody until its launcher has started
it again (or it rejoins), seconds later. The work does not give up then: a generate job, the
regeneration of a lost chunk, a weight sync that no worker took and a late worker's weight load
wait for the pool to have a worker again (:meth:`Fleet.pool_back`), and then run, on the worker
that came back (a process that came back under its id is a new candidate: workers are told apart
by id and incarnation). Each wait lasts at most ``faults.empty_pool_wait_s``; past it the run stops
with :class:`NoWorkerServed` naming the pool, what waited, how long, and the setting. A job whose
workers keep failing it is bounded as before, by ``faults.retry_attempts`` rounds, and by as many
waits for its pool (a worker that dies on it each time it is back); a weight sync by as many waits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rlfleet.common.control.membership import WorkerInfo, WorkerRegistry
from rlfleet.common.control.messages import (
    AnyMessage,
    CheckpointLoaded,
    GenerateRequest,
    GenerateResult,
    LoadCheckpoint,
    LoadWeights,
    Message,
    PublishWeights,
    SamplingParams,
    SaveCheckpoint,
    Saved,
    ScoreResult,
    TrainerConfigure,
    TrainerConfigured,
    TrainStepRequest,
    TrainStepResult,
    WeightsLoaded,
    WeightsPublished,
    speaks,
)
from rlfleet.common.control.messages.rollout import EpisodeSpec
from rlfleet.common.control.transport import Transport, subject
from rlfleet.common.errors import NoResponders, RemoteError, RemoteUserError, RequestTimeout
from rlfleet.common.schema.carriers import CarrierSetting, WeightCarrier, carrier_for
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.trainer import StepSettings
from rlfleet.common.tensors.weight_sync import PACKED_SINCE, verifiable
from rlfleet.controller.errors import (
    NoWorkerServed,
    RetriesExhausted,
    SettingsConflict,
    TrainerRestarted,
    WeightSyncMismatch,
    WorkerGone,
)
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.lost_chunks import ChunkOrders
from rlfleet.controller.ports import ChunkDone, ChunkOrder, FleetClient, RunState
from rlfleet.controller.request_policy import (
    POOL_POLL_S,
    Deadlines,
    backoff_s,
    give_up_at,
    is_retryable,
    with_retries,
)

if TYPE_CHECKING:
    from rlfleet.controller.reward_control import RewardControl

logger = logging.getLogger(__name__)


# --- sharing a step's prompts, noticing a worker going ----------------------------------------------


@dataclass
class Rounds:
    """A generate job's rounds so far: ``failed``, each live worker tried once (the first is one);
    ``emptied``, the pool left with nobody and waited for."""

    failed: int = 1
    emptied: int = 0


def life(worker: WorkerInfo) -> tuple[str, str]:
    """A worker process: its id and incarnation (a restart under the same id is another process)."""
    return worker.worker_id, worker.announce.incarnation


def split_by_capacity(total: int, capacities: Sequence[int]) -> list[int]:
    """Chunk sizes (summing to ``total``) proportional to ``capacities`` (largest remainder, so sizes
    sum exactly); zero-size chunks kept."""
    if not capacities:
        raise ValueError("split_by_capacity needs at least one worker capacity")
    weight = sum(capacities)
    exact = [total * c / weight for c in capacities]
    sizes = [int(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (sizes[i] - exact[i], i))
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


class GoneWatch:
    """Which workers left or died since the controller started, as awaitable events: one per
    worker, set when the registry sees a ``WorkerLeave`` or declares the worker dead.
    :meth:`request` races a request against that event, so a chunk on a dying worker is
    re-dispatched at once instead of after the full request timeout."""

    def __init__(self) -> None:
        self._gone: dict[str, asyncio.Event] = {}

    def _event(self, worker_id: str) -> asyncio.Event:
        return self._gone.setdefault(worker_id, asyncio.Event())

    def mark_gone(self, info: WorkerInfo) -> None:
        """Registry callback (``on_leave`` / ``on_dead``)."""
        self._event(info.worker_id).set()

    def mark_joined(self, info: WorkerInfo) -> None:
        """Registry callback (``on_join``): a worker that comes back is usable again."""
        self._gone.pop(info.worker_id, None)

    def is_gone(self, worker_id: str) -> bool:
        event = self._gone.get(worker_id)
        return event is not None and event.is_set()

    async def request(
        self, transport: Transport, worker: WorkerInfo, message: Message, *, timeout: float, job_id: str = ""
    ) -> AnyMessage:
        """``transport.request`` to ``worker``'s own subject, abandoned with :class:`WorkerGone`
        as soon as the worker leaves or is declared dead."""
        gone = self._event(worker.worker_id)
        if gone.is_set():
            raise WorkerGone(worker.tier, worker.worker_id, job_id)
        reply = asyncio.ensure_future(
            transport.request(worker.subject, message, timeout=timeout, tier=worker.tier)
        )
        watch = asyncio.ensure_future(gone.wait())
        try:
            done, _ = await asyncio.wait({reply, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reply, watch):
                if not task.done():
                    task.cancel()
            await asyncio.gather(reply, watch, return_exceptions=True)
        if reply in done:
            return reply.result()
        raise WorkerGone(worker.tier, worker.worker_id, job_id)


# --- the fleet ------------------------------------------------------------------------------------


class Fleet:
    """Requests to the rollout, reward and trainer tiers of one cluster (the run's
    :class:`~rlfleet.controller.ports.FleetClient`)."""

    def __init__(
        self, transport: Transport, cluster: str, *, request_timeout: float | None = None,
        dead_after: float = 10.0, faults: FaultSettings | None = None,
    ) -> None:  # fmt: skip
        self.transport = transport
        self.cluster = cluster
        self.faults = faults or FaultSettings()  # the retry budget of train, publish and weight-load requests
        self.deadlines = Deadlines(request_timeout, self.faults)  # from each request's work (None: scaled)
        self.trainer_incarnation = ""  # the trainer process the run configured ('' until it is)
        self.gone = GoneWatch()
        self.registry = WorkerRegistry(
            transport, cluster, dead_after=dead_after, on_join=self.gone.mark_joined,
            on_leave=self.gone.mark_gone, on_dead=self.gone.mark_gone,
        )  # fmt: skip
        self.published: WeightsPublished | None = None  # the last version every rollout worker must hold
        self._hold = False  # workers keep a host copy of what they load (delta sync)
        self._admitting: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.reward: RewardControl | None = None  # set by attach_reward: scores go through it, token and all
        self._jobs = itertools.count()
        self.orders = ChunkOrders()  # what each rollout chunk was asked for (lost_chunks.py)
        self._run = uuid.uuid4().hex[:8]

    async def start(self) -> None:
        await self.registry.start()

    async def close(self) -> None:
        if self.reward is not None:
            await self.reward.close()
        await self.registry.stop()

    async def wait_ready(self, counts: dict[str, int], timeout: float) -> None:
        """Wait until each tier has announced at least ``counts[tier]`` workers.

        Raises ``TimeoutError`` (naming the first tier that fell short) after ``timeout`` seconds.
        """
        waits = [
            asyncio.ensure_future(self.registry.wait_for(tier, n, timeout)) for tier, n in counts.items() if n
        ]
        try:
            await asyncio.gather(*waits)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    def _job_id(self, what: str) -> str:
        return f"{self._run}-{what}-{next(self._jobs)}"

    def rollout_workers(self, pool: str | None = None, weight_version: int = -1) -> list[WorkerInfo]:
        """Live rollout workers (of ``pool``; at ``weight_version`` or newer unless it is -1), by id.

        Newer serves: in a pipelined run (``max_staleness``) a job sent at one version may meet a
        worker that has loaded the next since; in a synchronous one no worker is ever ahead."""
        workers = self.registry.workers("rollout", pool)
        return [w for w in workers if weight_version < 0 or w.weight_version >= weight_version]

    async def _admitted(self, pool: str | None, weight_version: int) -> list[WorkerInfo]:
        """Workers that may serve ``weight_version``; a stale one (joined late) is sent the published
        buckets in the background, and waited for only when nobody else can serve."""
        admitted = self.rollout_workers(pool, weight_version)
        stale = [w for w in self.rollout_workers(pool) if w not in admitted]
        published = self.published
        if weight_version < 0 or not stale or published is None or published.weight_version < weight_version:
            return admitted
        tasks = [self.admit(w, published) for w in stale]
        if not admitted:
            await asyncio.gather(*tasks, return_exceptions=True)
            admitted = self.rollout_workers(pool, weight_version)
        return admitted

    def admit(self, worker: WorkerInfo, published: WeightsPublished) -> asyncio.Task[None]:
        """Load ``published`` into a stale (late) rollout worker, in the background; one load per
        worker and version, however often it is asked for."""
        key = (worker.worker_id, published.weight_version)
        task = self._admitting.get(key)
        if task is None:
            task = self._admitting[key] = asyncio.create_task(self._load_one(worker, published))
        return task

    async def _load_one(self, worker: WorkerInfo, published: WeightsPublished) -> None:
        message = LoadWeights(weight_version=published.weight_version, buckets=published.buckets,
                              ipc_buckets=published.ipc_buckets, job_id=self._job_id("load"),
                              hold=self._hold and published.adapter is None,
                              adapter=published.adapter)  # fmt: skip
        try:
            reply = await self._load_request(worker, message)
            assert isinstance(reply, WeightsLoaded), reply
            self._check_loaded(reply)
        except (RequestTimeout, ConnectionError, RemoteError, RetriesExhausted, WeightSyncMismatch) as exc:
            logger.warning("rollout worker %s did not catch up to version %d: %s", worker.worker_id,
                           published.weight_version, exc)  # fmt: skip
            self._admitting.pop((worker.worker_id, published.weight_version), None)
            return
        info = self.registry.get("rollout", worker.worker_id)
        if info is not None:
            info.weight_version = reply.weight_version
        logger.info("rollout worker %s admitted at weight version %d", worker.worker_id, reply.weight_version)

    async def pool_back(
        self,
        pool: str | None,
        weight_version: int,
        what: str,
        avoid: frozenset[tuple[str, str]] = frozenset(),
    ) -> list[WorkerInfo]:
        """The workers of ``pool`` (None: any) that serve ``weight_version`` (-1: any), but for the
        processes in ``avoid``, once there is one: waited for while the pool is empty (a stale
        worker that is back is sent the published weights first), at most ``faults.empty_pool_wait_s``;
        past it :class:`NoWorkerServed` names the pool, ``what`` waited and the setting."""
        loop = asyncio.get_running_loop()
        since = loop.time()
        where = f"rollout pool {pool!r}" if pool is not None else "the rollout fleet"
        waited = False
        while True:
            workers = [w for w in await self._admitted(pool, weight_version) if life(w) not in avoid]
            if workers:
                if waited:
                    back = ", ".join(w.worker_id for w in workers)
                    logger.warning("%s has a worker again (%s) after %.1f s; %s goes on", where, back,
                                   loop.time() - since, what)  # fmt: skip
                return workers
            left = since + self.faults.empty_pool_wait_s - loop.time()
            if left <= 0:
                raise self._pool_empty(where, weight_version, what, loop.time() - since)
            if not waited:
                logger.warning("%s has no live worker; %s waits for one to be restarted or to rejoin (up to "
                               "%.0f s more, faults.empty_pool_wait_s)", where, what, left)  # fmt: skip
                waited = True
            await asyncio.sleep(min(POOL_POLL_S, left))

    def _pool_empty(self, where: str, weight_version: int, what: str, empty_s: float) -> NoWorkerServed:
        version = f" at weight version {weight_version}" if weight_version >= 0 else ""
        return NoWorkerServed(
            f"{what}: {where} of cluster {self.cluster} had no live worker{version} for {empty_s:.0f} s "
            f"(faults.empty_pool_wait_s={self.faults.empty_pool_wait_s:g}): none was restarted or rejoined "
            "in time (the launcher restarts a worker within faults.restart_budget)"
        )

    def forget(self, tier: str, worker_id: str) -> None:
        """Forget a worker that is gone (crashed, restarted, removed): requests in flight to it end
        now with ``WorkerGone``, not at their deadline; a new process under its id is admitted when
        it announces."""
        info = self.registry.forget(tier, worker_id)
        if info is not None:
            self.gone.mark_gone(info)

    def is_gone(self, worker_id: str) -> bool:
        """Whether the registry saw ``worker_id`` leave or declared it dead (and it has not come back)."""
        return self.gone.is_gone(worker_id)

    # --- rollout ----------------------------------------------------------------------------

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        weight_version: int,
        *,
        pool: str | None = None,
        on_chunk: ChunkDone | None = None,
        episode: EpisodeSpec | None = None,
    ) -> list[GenerateResult]:
        """Split prompts over the admitted rollout workers (those at ``weight_version``, of ``pool``)
        in proportion to their capacity; a chunk whose worker fails, leaves or dies goes to another.

        Returns one result per chunk, in prompt order (chunk i holds a contiguous slice), so every
        prompt is answered exactly once. ``on_chunk(first, result)`` is told of each chunk as soon
        as it is generated (``first``: the index of its first prompt in ``prompts``), while the
        others still are: the step scores it then (:mod:`rlfleet.controller.lost_chunks`).
        ``episode``: each prompt is a multi-turn episode (its ``items``, one per prompt, split with
        the prompts).
        """  # fmt: skip
        workers = await self._admitted(pool, weight_version)
        if not workers:
            what = f"generating {len(prompts)} prompts at weight version {weight_version}"
            workers = await self.pool_back(pool, weight_version, what)
        sizes = split_by_capacity(len(prompts), [w.announce.capacity for w in workers])

        async def one(first: int, chunk: list[list[int]], preferred: str) -> GenerateResult:
            episodes = None
            if episode is not None:  # the chunk's own items
                episodes = episode.model_copy(update={"items": episode.items[first : first + len(chunk)]})
            result = await self._generate_chunk(chunk, sampling, weight_version, preferred, pool,
                                                episode=episodes)  # fmt: skip
            if on_chunk is not None:
                on_chunk(first, result)
            return result

        tasks, start = [], 0
        for worker, size in zip(workers, sizes, strict=True):
            if size:
                tasks.append(one(start, [list(p) for p in prompts[start : start + size]], worker.worker_id))
            start += size
        return list(await asyncio.gather(*tasks))

    async def _generate_chunk(
        self,
        chunk: list[list[int]],
        sampling: SamplingParams,
        weight_version: int,
        preferred: str,
        pool: str | None = None,
        avoid: frozenset[tuple[str, str]] = frozenset(),
        episode: EpisodeSpec | None = None,
    ) -> GenerateResult:
        """One chunk's generate job on a live worker of ``pool`` (``preferred`` first), never on a
        process in ``avoid`` (worker id, incarnation); an empty pool is waited for."""
        request = GenerateRequest(
            job_id=self._job_id("gen"),
            prompt_token_ids=chunk,
            sampling=sampling,
            weight_version=weight_version,
            episode=episode,
        )
        tried: set[tuple[str, str]] = set(avoid)
        rounds = Rounds()
        while True:
            alive = [w for w in self.rollout_workers(pool, weight_version) if life(w) not in avoid]
            candidates = sorted(
                (w for w in alive if life(w) not in tried), key=lambda w: w.worker_id != preferred
            )
            if not candidates:  # every live worker failed it, or none is left: another round, or give up
                await self._next_round(rounds, request.job_id, pool, weight_version, alive, tried, avoid)
                tried = set(avoid)  # the same job id: a worker answers a repeat once
                continue
            worker = candidates[0]
            tried.add(life(worker))
            try:
                timeout = self.deadlines.generate(request, worker.announce.gpu_uuids)
                request.deadline = give_up_at(timeout)  # this try's: the worker cancels the job past it
                reply = await self.gone.request(self.transport, worker, request, timeout=timeout,
                                                job_id=request.job_id)  # fmt: skip
            except (RequestTimeout, ConnectionError) as exc:  # WorkerGone and NoResponders included
                logger.warning("rollout worker %s failed job %s: %s; re-dispatching", worker.worker_id,
                               request.job_id, exc)  # fmt: skip
                continue
            except RemoteError as exc:
                if not exc.retryable:
                    raise
                logger.warning("rollout worker %s: %s; trying another", worker.worker_id, exc)
                continue
            assert isinstance(reply, GenerateResult), reply
            incarnation = worker.announce.incarnation
            order = ChunkOrder(chunk, sampling, weight_version, pool, worker.worker_id, incarnation, episode)
            self.orders.record(reply, order)  # so that a chunk lost with its worker can be made again
            return reply

    async def _next_round(
        self, rounds: Rounds, job_id: str, pool: str | None, weight_version: int, alive: list[WorkerInfo],
        tried: set[tuple[str, str]], avoid: frozenset[tuple[str, str]],
    ) -> None:  # fmt: skip
        """Wait before a generate job's next round: a backoff when its live workers all failed it,
        the pool's return (:meth:`pool_back`) when none is left; raise :class:`NoWorkerServed` when
        ``faults.retry_attempts`` rounds of either kind were spent."""
        attempts = self.faults.retry_attempts
        if alive and rounds.failed < attempts:
            wait = backoff_s(self.faults, rounds.failed)
            failed = sorted(w for w, _ in tried)
            logger.warning("generate job %s: every rollout worker failed it (%s); try %d of %d in %.1f s",
                           job_id, failed, rounds.failed + 1, attempts, wait)  # fmt: skip
            rounds.failed += 1
            await asyncio.sleep(wait)
        elif not alive and rounds.emptied < attempts:  # nobody left (but the process that lost it)
            rounds.emptied += 1
            await self.pool_back(pool, weight_version, f"generate job {job_id}", avoid)
        else:
            raise NoWorkerServed(
                f"generate job {job_id}: every rollout worker failed it ({sorted(w for w, _ in tried)}; "
                f"{rounds.failed} rounds, its pool emptied {rounds.emptied} times; faults.retry_attempts="
                f"{attempts})"
            )

    async def regenerate(self, order: ChunkOrder) -> GenerateResult:
        """The chunk ``order`` describes generated again (its prompts, sampling seed, weight version and
        pool) by a live worker, not by the process that lost it (a new one under its id may serve),
        unless that process still lives and is its pool's only worker at that version: it dropped the
        chunk (its store's TTL, a load's release) and makes it again, rather than the step waiting
        ``faults.empty_pool_wait_s`` for another. A store it cannot serve loses the chunk again, and
        ``faults.retry_attempts`` bounds the rounds."""
        producer = (order.worker_id, order.incarnation)
        serving = [life(w) for w in self.rollout_workers(order.pool, order.weight_version)]
        lone = serving == [producer]
        if lone:
            logger.warning("rollout worker %s dropped a chunk and is its pool's only worker at version "
                           "%d: it generates it again", order.worker_id, order.weight_version)  # fmt: skip
        avoid = frozenset() if lone else frozenset({producer})  # that process, not a new one under its id
        return await self._generate_chunk(order.prompts, order.sampling, order.weight_version, "", order.pool,
                                          avoid, order.episode)  # fmt: skip

    async def load_weights(
        self, published: WeightsPublished, keep_from_version: int = -1, *, hold: bool = False
    ) -> list[WeightsLoaded]:
        """Every rollout worker pulls the published buckets straight from the trainer's store; when
        every one went meanwhile (the fleet momentarily empty), the first to be back loads them.
        The workers keep their batches generated at ``keep_from_version`` or later (-1: at the
        version loaded; a pipelined run trains older ones after this load).

        A LoRA adapter (``published.adapter``) goes to every worker whole; the engines apply it to
        the base they hold. Delta sync: a worker that holds ``published.delta_from`` pulls only the
        delta (one that turns out to hold no copy of it is sent the whole version); ``hold`` has
        every worker keep a host copy of what it loads, for the next delta. Every load is verified:
        a worker whose fingerprint differs from the published one raises :class:`WeightSyncMismatch`."""
        self.published = published
        self._admitting = {k: t for k, t in self._admitting.items() if k[1] == published.weight_version}
        hold = hold and published.adapter is None  # an adapter travels whole: no copy kept for a delta
        message = LoadWeights(weight_version=published.weight_version, buckets=published.buckets,
                              ipc_buckets=published.ipc_buckets, job_id=self._job_id("load"),
                              keep_from_version=keep_from_version, hold=hold,
                              adapter=published.adapter)  # fmt: skip
        self._hold = hold
        loaded, waits = await self._load_all(message), 0
        while not loaded:  # every worker went meanwhile: the first back loads it
            if waits >= self.faults.retry_attempts:
                version = published.weight_version
                raise NoWorkerServed(f"no rollout worker loaded weight version {version}: the rollout fleet "
                                     f"emptied {waits} times (faults.retry_attempts)")  # fmt: skip
            waits += 1
            await self.pool_back(None, -1, f"loading weight version {published.weight_version}")
            loaded = await self._load_all(message)
        return loaded

    async def _load_all(self, message: LoadWeights) -> list[WeightsLoaded]:
        """``message`` to every live rollout worker; the replies of those that loaded it (a worker
        that went meanwhile is skipped: it is admitted at this version when it is back)."""
        workers = self.rollout_workers()
        loads = (self._load_version(w, message) for w in workers)
        replies = await asyncio.gather(*loads, return_exceptions=True)
        loaded: list[WeightsLoaded] = []
        for worker, reply in zip(workers, replies, strict=True):
            if isinstance(reply, WorkerGone | NoResponders):
                logger.warning("rollout worker %s is gone; it will not hold version %d", worker.worker_id,
                               message.weight_version)  # fmt: skip
                continue
            if isinstance(reply, BaseException):
                raise reply
            assert isinstance(reply, WeightsLoaded), reply
            self._check_loaded(reply)
            worker.weight_version = reply.weight_version
            loaded.append(reply)
        return loaded

    async def _load_version(self, worker: WorkerInfo, message: LoadWeights) -> AnyMessage:
        """``message`` to one worker, as a delta when it holds the version the published delta
        applies to; the whole version when it turns out to hold no copy of it."""
        published = self.published
        if published is None or not published.delta_buckets or worker.weight_version != published.delta_from:
            return await self._load_request(worker, message)
        if not speaks(worker.announce.protocol, PACKED_SINCE):  # reads only the per-weight form
            logger.info("rollout worker %s speaks wire %s, before packed deltas: it loads version %d whole",
                        worker.worker_id, worker.announce.protocol, message.weight_version)  # fmt: skip
            return await self._load_request(worker, message)
        delta = message.model_copy(update={"delta_buckets": published.delta_buckets,
                                           "delta_from": published.delta_from,
                                           "job_id": self._job_id("load")})  # fmt: skip
        try:
            return await self._load_request(worker, delta)
        except RemoteError as exc:
            if exc.code != "delta_base":
                raise
            logger.info("rollout worker %s holds no copy of version %d: it loads version %d whole",
                        worker.worker_id, published.delta_from, message.weight_version)  # fmt: skip
            return await self._load_request(worker, message)

    def _check_loaded(self, reply: WeightsLoaded) -> None:
        """Raise :class:`WeightSyncMismatch` when ``reply``'s fingerprint is not the published one
        (either empty: not computed on that side, or of another scheme, from a release before or
        after this one's: nothing to compare)."""
        published = self.published
        if published is None or published.weight_version != reply.weight_version:
            return
        mine, theirs = published.fingerprint, reply.fingerprint
        if verifiable(mine, theirs) and theirs != mine:
            raise WeightSyncMismatch(reply.worker_id, reply.weight_version, published.fingerprint,
                                     reply.fingerprint)  # fmt: skip

    async def _load_request(self, worker: WorkerInfo, message: LoadWeights) -> AnyMessage:
        """One worker's weight load, retried on a retryable error while the worker lives (a gone
        worker is not waited for: it is admitted at the current version when it is back)."""
        return await with_retries(
            f"rollout worker {worker.worker_id} loading weight version {message.weight_version}",
            lambda: self.gone.request(self.transport, worker, message,
                                      timeout=self.deadlines.load_weights(message)),
            self.faults, retry_if=lambda exc: is_retryable(exc) and not isinstance(exc, NoResponders),
        )  # fmt: skip

    # --- reward -----------------------------------------------------------------------------

    async def score(
        self, results: Sequence[GenerateResult], metadata: Sequence[Sequence[dict[str, Any]]], endpoint: str
    ) -> list[ScoreResult]:
        """Score each rollout chunk on the reward tier; ``metadata[i]`` is chunk i's per-prompt metadata."""
        assert self.reward is not None, "the run attaches its reward tier before scoring"
        job_ids = [self._job_id("score") for _ in results]
        return list(await self.reward.score(results, metadata, endpoint, job_ids))

    # --- trainer ----------------------------------------------------------------------------

    def _trainer(self, verb: str) -> str:
        return subject(self.cluster, "trainer", verb)

    async def configure_trainer(self, message: TrainerConfigure) -> TrainerConfigured:
        """Tell the trainer the run's fixed settings; a trainer whose own differ refuses, and
        :class:`SettingsConflict` names it and each conflicting field."""
        try:
            reply = await self.transport.request(
                self._trainer("configure"), message, timeout=self.deadlines.control(), tier="trainer"
            )
        except RemoteUserError as exc:
            if exc.code != "settings_conflict":
                raise
            workers = ", ".join(w.worker_id for w in self.registry.workers("trainer")) or "(unknown)"
            raise SettingsConflict.from_reply("trainer", workers, exc.remote_message) from None
        assert isinstance(reply, TrainerConfigured), reply
        self.trainer_incarnation = reply.incarnation
        return reply

    def _same_trainer(self, reply: Any) -> None:
        """Refuse a reply from another trainer process than the one the run configured (a restart
        that lost the run's state): :class:`TrainerRestarted`, never adopted."""
        now = getattr(reply, "incarnation", "")
        if self.trainer_incarnation and now and now != self.trainer_incarnation:
            workers = ", ".join(w.worker_id for w in self.registry.workers("trainer")) or "trainer"
            raise TrainerRestarted(workers, self.trainer_incarnation, now)

    async def _trainer_request(self, verb: str, what: str, message: Message, timeout: float) -> Any:
        """A trainer request with the run's retry budget; the message (and its job id) stays the
        same on every try, so a trainer that did the work answers the repeat from its cache."""
        reply = await with_retries(
            what,
            lambda: self.transport.request(self._trainer(verb), message, timeout=timeout, tier="trainer"),
            self.faults,
        )
        self._same_trainer(reply)
        return reply

    async def train_step(
        self, step: int, rollouts: Sequence[TensorRef], scores: Sequence[float], settings: StepSettings,
        groups: Sequence[Sequence[int]] | None = None,
    ) -> TrainStepResult:  # fmt: skip
        """One update on the referenced batches (rollouts, or DPO preference pairs), as ``settings`` say
        (``groups``: per rollout chunk, the groups it trains on; ``scores`` are theirs)."""
        kept = {"groups": [list(g) for g in groups]} if groups is not None else {}
        request = TrainStepRequest(step=step, rollouts=list(rollouts), scores=list(scores), settings=settings,
                                   job_id=self._job_id("step"), **kept)  # fmt: skip
        timeout = self.deadlines.train_step(request.rollouts, self._trainer_gpus())
        reply = await self._trainer_request("step", f"train step {step}", request, timeout)
        assert isinstance(reply, TrainStepResult), reply
        return reply

    def _trainer_gpus(self) -> list[str]:
        trainers = self.registry.workers("trainer")
        return trainers[0].announce.gpu_uuids if trainers else []

    def weight_carriers(self, setting: CarrierSetting) -> list[WeightCarrier]:
        """The carriers the live rollout workers need from the trainer, one per link (see
        :func:`~rlfleet.common.schema.carriers.carrier_for`); ``cuda_ipc`` that cannot reach a
        worker raises."""
        trainer_gpus = self._trainer_gpus()
        chosen = {carrier_for(setting, trainer_gpus, w.announce.gpu_uuids) for w in self.rollout_workers()}
        return sorted(chosen) or ["grpc"]

    async def publish_weights(
        self, bucket_mb: float, weight_version: int = -1, *, carrier: CarrierSetting = "grpc",
        dtype: str = "", delta: bool = False, adapter: bool = False,
    ) -> WeightsPublished:  # fmt: skip
        """Stage the trainer's weights as ``weight_version`` (-1: the next one), for the carriers the
        rollout workers need under ``carrier`` (``auto``: CUDA IPC to workers on the trainer's GPU);
        ``delta``: also their change from the version before (delta sync); ``adapter``: a LoRA
        trainer's adapter alone (over gRPC)."""
        message = PublishWeights(bucket_mb=bucket_mb, weight_version=weight_version,
                                 carriers=self.weight_carriers(carrier), dtype=dtype,
                                 job_id=self._job_id("publish"), delta=delta, adapter=adapter)  # fmt: skip
        reply = await self._trainer_request("publish", "weight publish", message, self.deadlines.publish())
        assert isinstance(reply, WeightsPublished), reply
        self.deadlines.published(reply.nbytes)
        return reply

    async def save(self, path: str, mode: Literal["hf", "full"] = "hf") -> str:
        """Have the trainer save to ``path``: an HF export, or (``full``) that plus its training state."""
        reply = await self.transport.request(
            self._trainer("save"), SaveCheckpoint(path=path, mode=mode),
            timeout=self.deadlines.checkpoint(mode == "full"), tier="trainer",
        )  # fmt: skip
        assert isinstance(reply, Saved), reply
        self._same_trainer(reply)
        return reply.path

    async def load_checkpoint(self, path: str, weight_version: int) -> CheckpointLoaded:
        """Have the trainer restore the training state of the full checkpoint in ``path``."""
        reply = await self.transport.request(
            self._trainer("load"), LoadCheckpoint(path=path, weight_version=weight_version),
            timeout=self.deadlines.checkpoint(True), tier="trainer",
        )  # fmt: skip
        assert isinstance(reply, CheckpointLoaded), reply
        return reply


# --- a run's weights out ----------------------------------------------------------------------------


async def publish(
    fleet: FleetClient, state: RunState, weight_version: int = -1
) -> tuple[WeightsPublished, list[WeightsLoaded]]:
    """Publish the trainer's weights (as ``weight_version``; -1: the next, in the run's
    ``publish_dtype``) and have every rollout worker load them; the run (``state``) then generates at
    that version. The workers keep the batches generated up to ``max_staleness`` versions back (a
    pipelined run's batches generated ahead, trained after this load)."""
    cfg = state.config
    sync = cfg.weight_sync
    anchor = (state.weight_version + 1) % sync.anchor_every == 0  # every anchor_every-th version: whole
    adapter = sync.adapter and cfg.model.lora is not None  # LoRA: the adapter alone
    published = await fleet.publish_weights(
        cfg.weight_bucket_mb, weight_version, carrier=cfg.weight_carrier, dtype=state.publish_dtype,
        **({"delta": True} if sync.delta and not anchor and not adapter else {}),
        **({"adapter": True} if adapter else {}),
    )  # fmt: skip
    keep = max(published.weight_version - cfg.max_staleness, 0) if cfg.max_staleness else -1
    loaded = await fleet.load_weights(published, keep, **({"hold": True} if sync.delta else {}))
    state.weight_version = published.weight_version
    return published, loaded
