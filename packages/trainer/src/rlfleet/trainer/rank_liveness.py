"""Whether the other trainer ranks are alive: heartbeats in the ranks' rendezvous store.

Rank 0 alone talks to NATS, so its heartbeats there say nothing of ranks 1..W-1. A follower that
dies (SIGKILL, the OOM killer, a lost node) would leave rank 0 heartbeating while it waits in a
collective for the dead rank until the process group's timeout. So each follower counts a key of
its own up in the c10d TCPStore that rank 0 holds (``MASTER_ADDR:MASTER_PORT``), every
:data:`BEAT_S` seconds, on a thread of its own (a rank busy in a long collective still beats);
rank 0 reads the counters every second (:class:`RankWatch`). A rank whose counter stood still for
``rank_silence_s`` is reported as :class:`~rlfleet.trainer.errors.TrainerRankDied`: rank 0
answers the request in progress (or the next one) with it, logs it, and exits with
:data:`RANK_LOST_EXIT` a few seconds later, whatever its rank thread is stuck in, so that the
launcher (or torchrun, or the orchestrator) restarts the ranks together. A follower whose beat
fails has lost rank 0 (its store is gone) and exits the same way (:class:`RankHeartbeat`).

Rank 0 failing a command after its first collective (its weight store full in the middle of a
publish, an error in a backward) leaves the followers in collectives it will not join:
:meth:`RankWatch.guard` answers that request and every later one with
:class:`~rlfleet.trainer.errors.RanksOutOfStep` and the process exits the same way.

Both threads use a TCPStore client of their own, never the process group's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from rlfleet.common.errors import RlfleetError
from rlfleet.trainer.distributed import DistContext
from rlfleet.trainer.errors import RanksOutOfStep, TrainerRankDied, TrainerRankFailed

logger = logging.getLogger(__name__)
T = TypeVar("T")

BEAT_S = 2.0
"""How often a follower counts its heartbeat up."""

RANK_LOST_EXIT = 75
"""The exit status of a rank that lost another (EX_TEMPFAIL: starting the ranks again can help)."""

VERDICT_S = 3 * BEAT_S + 10.0
"""How long a follower whose collective broke waits for its heartbeat to find rank 0 gone (the
store client's timeout included) before it ends with the collective's own error."""

EXIT_GRACE_S = 3.0
"""How long rank 0 waits after reporting a dead rank before it exits (its reply goes out)."""


def beat_key(rank: int) -> str:
    return f"rlfleet/rank-beat/{rank}"


def _store_client() -> dist.TCPStore:
    """A client of the rendezvous store (the torchrun variables say where rank 0 serves it)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))


def _quiet(task: asyncio.Future[object]) -> None:
    """Retrieve the outcome of work abandoned for a dead rank (it is not logged as unretrieved)."""
    if not task.cancelled():
        task.exception()


def _exit_later(error: BaseException) -> None:
    time.sleep(EXIT_GRACE_S)  # the answer goes out first
    _exit_lost(error)


def _exit_lost(error: BaseException) -> None:
    """End this process at once with ``error`` as its last line (the launcher reports that line)."""
    print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
    os._exit(RANK_LOST_EXIT)


class RankHeartbeat:
    """A follower's heartbeat; the process exits when rank 0's store stops answering (rank 0 is gone)."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rank{ctx.rank}-heartbeat", daemon=True)

    def start(self) -> RankHeartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating (rank 0 said stop: its store may go away now)."""
        self._stopped.set()

    def _run(self) -> None:
        key, last = beat_key(self.ctx.rank), time.monotonic()
        try:
            store = _store_client()
            while not self._stopped.is_set():
                store.add(key, 1)
                last = time.monotonic()
                self._stopped.wait(BEAT_S)
        except Exception as exc:  # the store is rank 0's: it is gone
            if self._stopped.is_set():
                return
            how = f"its rendezvous store does not answer: {exc}"
            error = TrainerRankDied(0, time.monotonic() - last, how=how, then=f"rank {self.ctx.rank} exits")
            logger.error("%s", error)
            _exit_lost(error)


class RankWatch:
    """Rank 0's watch over ranks 1..W-1 (see the module docstring); ``doing()`` names what rank 0 is
    doing, for the report. Work of every rank goes through :meth:`guard`, which ends with the
    report as soon as a rank is found dead (the work itself may never end: it waits for that rank).
    """

    def __init__(self, ctx: DistContext, silence_s: float, doing: Callable[[], str] = lambda: "") -> None:
        self.ctx, self.silence_s, self.doing = ctx, silence_s, doing
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-watch", daemon=True)
        self._lost: asyncio.Future[None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> RankWatch:
        """Start watching; a dead rank fails the work :meth:`guard` awaits on ``loop``."""
        self._loop, self._lost = loop, loop.create_future()
        self._thread.start()
        return self

    async def guard(self, work: Awaitable[T], own: BaseException | None = None) -> T:
        """``await work``, or raise :class:`TrainerRankDied` once a rank is found dead (at once when
        one already is).

        Work that fails leaves the ranks in step only with ``own`` (this rank's own part failed,
        and every rank agreed to skip) or :class:`TrainerRankFailed` (another rank's part). An error
        of the collectives themselves (a ``RuntimeError`` such as gloo's "connection reset by
        peer") first waits up to ``rank_silence_s`` for the watch to name a dead rank, and raises
        that when it does. Any other failure left the other ranks in collectives this rank will
        not join: :class:`RanksOutOfStep` is raised (and every later request gets it), and the
        process exits :data:`EXIT_GRACE_S` later."""
        lost = self._lost
        assert lost is not None, "start() the watch first"
        if lost.done():
            if asyncio.iscoroutine(work):
                work.close()
            raise lost.exception()  # type: ignore[misc]
        task = asyncio.ensure_future(work)
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.add_done_callback(_quiet)
            raise lost.exception()  # type: ignore[misc]
        error = task.exception()
        if error is None or error is own or isinstance(error, TrainerRankFailed):
            return task.result()
        if isinstance(error, RuntimeError) and not isinstance(error, RlfleetError):
            await asyncio.wait({lost}, timeout=self.silence_s + 2 * BEAT_S)
        if not lost.done():
            failure = RanksOutOfStep(self.doing(), error)
            logger.error("%s", failure)
            lost.set_exception(failure)
            threading.Thread(target=_exit_later, args=(failure,), name="rank-exit", daemon=True).start()
        raise lost.exception() from error  # type: ignore[misc]

    def stop(self) -> None:
        """Stop watching (rank 0 stops the followers: their silence is expected now)."""
        self._stopped.set()

    def _run(self) -> None:
        store = _store_client()
        now = time.monotonic()
        counts = dict.fromkeys(range(1, self.ctx.world_size), -1)
        seen = dict.fromkeys(counts, now)
        while not self._stopped.wait(1.0):
            now = time.monotonic()
            for rank in counts:
                try:
                    count = store.add(beat_key(rank), 0)
                except Exception as exc:  # its own store: a hiccup, not a dead peer
                    logger.warning("could not read trainer rank %d's heartbeat: %s", rank, exc)
                    continue
                if count != counts[rank]:
                    counts[rank], seen[rank] = count, now
                elif now - seen[rank] > self.silence_s and not self._stopped.is_set():
                    self._dead(TrainerRankDied(rank, now - seen[rank], self.doing()))
                    return

    def _dead(self, error: TrainerRankDied) -> None:
        logger.error("%s", error)
        try:
            self._loop.call_soon_threadsafe(self._fail, error)
        except RuntimeError:  # the loop is closed: nobody waits for an answer
            pass
        _exit_later(error)

    def _fail(self, error: TrainerRankDied) -> None:
        if self._lost is not None and not self._lost.done():
            self._lost.set_exception(error)
