"""The stall watchdog (issue 12): a worker that owes the controller a result for too long is named.

Every request the controller makes is tracked while it waits (:meth:`Watchdog.track`, or all of a
transport's requests through :meth:`Watchdog.watch`, which knows each request's deadline, scaled
from its work by :class:`~rlfleet.controller.request_policy.Deadlines`). A request is reported,
with what the membership registry knows of its worker, when it has waited

- ``stall_report_s`` while no worker it may be on is heard from and busy (a silent or dead worker,
  or one that reports no work: it is not working on it);
- its deadline (at least ``stall_report_s``) while one is heard from and busy: a request within a
  deadline that matches its work is not a stall (a held-out evaluation of many prompts is long
  work, not a stuck worker);

and again each ``stall_report_s`` after::

    rollout worker rollout-1 alive and heartbeating (last beat 1 s ago) but no result for 75 s on
    generate job 3f2a-gen-7 (it reports: generate 3f2a-gen-7 for 74 s)
    trainer worker trainer-0 not heard for 40 s; no result for 62 s on trainer.step job 3f2a-step-2

The report is a warning in the log, an entry of :attr:`Watchdog.reports` and a call of
``on_report``; the request itself goes on (its deadline and the registry decide its fate).
:attr:`Watchdog.longest_s` is the longest wait of any request so far (the chaos benchmark's
"longest stall").

Two cases are acted on. A request whose deadline passes while a worker it may be on is heard from
and busy (its heartbeats say so) gets the deadline again, up to ``max_extensions`` times (7: 8x the
deadline in all), with a warning each time: on an overloaded machine work is slow, not lost, and
failing it would only start it again from nothing. And a worker that heartbeats and reports no work
in progress for ``lost_after_s`` (30 s) while a request to it is still unanswered has finished or
dropped it, and its answer is not coming (a reply refused by the NATS server, a handler that ended
without answering). Waiting on would only wait out the request's deadline, so the request ends with
:class:`RequestLost` (a :class:`RequestTimeout`: retried and re-dispatched like one) naming the
worker and the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rlfleet.common.control.membership import WorkerInfo, WorkerRegistry
from rlfleet.common.control.messages import AnyMessage, Message
from rlfleet.common.control.transport import Transport
from rlfleet.common.errors import RequestTimeout

logger = logging.getLogger(__name__)

SILENT_AFTER_S = 6.0
"""A worker unheard for this long is reported as not heard from (three beats of the default 2 s)."""

LOST_AFTER_S = 30.0
"""A request whose worker(s) heartbeat as idle this long, after it was sent, is given up as lost."""


MAX_EXTENSIONS = 7
"""A request whose deadline passes while its worker is alive and busy gets its deadline again, up to
this many times (8x the deadline in all): a loaded machine is slow, not broken."""


class RequestLost(RequestTimeout):
    """A live worker reports no work in progress, yet never answered the request: its answer is lost."""

    def __init__(self, subject: str, tier: str, waited_s: float, reason: str) -> None:
        super().__init__(subject, tier, waited_s)
        self.args = (reason,)


@dataclass
class Waiting:
    """One request the controller is waiting on."""

    tier: str
    worker_id: str | None  # None: a tier's request (the trainer's verbs): any worker of the tier
    what: str
    job_id: str
    since: float
    reported: int = 0  # how many times it was reported
    subject: str = ""
    idle_since: float | None = None  # when its worker(s) were first seen idle after it was sent
    deadline_s: float | None = None  # the request's deadline from its work; None: not known
    lost: asyncio.Future[RequestLost] | None = None  # set when it is given up


@dataclass(frozen=True)
class StallReport:
    """A request that waited too long, and what the registry knew of its worker(s) then."""

    tier: str
    worker_id: str  # the worker, or the tier's workers (comma-separated), or "" when none is known
    what: str
    job_id: str
    waited_s: float
    heard_s: float | None  # since the worker's last heartbeat; None when it is not in the registry
    activity: str
    activity_s: float
    message: str


class Watchdog:
    """Names the workers that owe a result for more than ``stall_report_s`` s.

    ``registry`` (or :meth:`attach`) is where workers' heartbeats are seen; ``silent_after_s`` the
    silence after which a worker is "not heard" rather than "alive and heartbeating".
    """

    def __init__(
        self,
        stall_report_s: float = 60.0,
        *,
        registry: WorkerRegistry | None = None,
        silent_after_s: float = SILENT_AFTER_S,
        on_report: Callable[[StallReport], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        lost_after_s: float | None = LOST_AFTER_S,
        max_extensions: int = MAX_EXTENSIONS,
    ) -> None:
        if stall_report_s <= 0:
            raise ValueError(f"stall_report_s must be > 0 s, got {stall_report_s}")
        if lost_after_s is not None and lost_after_s <= 0:
            raise ValueError(f"lost_after_s must be > 0 s (or None: never give up), got {lost_after_s}")
        self.lost_after_s = lost_after_s
        if max_extensions < 0:
            raise ValueError(f"max_extensions must be >= 0, got {max_extensions}")
        self.max_extensions = max_extensions
        self.stall_report_s = stall_report_s
        self.registry = registry
        self.silent_after_s = silent_after_s
        self.on_report = on_report
        self.clock = clock
        self.reports: list[StallReport] = []
        self.longest_s = 0.0
        self._waiting: dict[int, Waiting] = {}
        self._ids = itertools.count()
        self._checker: asyncio.Task[None] | None = None

    def attach(self, registry: WorkerRegistry) -> None:
        """Read workers' liveness and activity from ``registry`` (the fleet's, once it is built)."""
        self.registry = registry

    def watch(self, transport: Transport) -> WatchedTransport:
        """``transport`` with every request tracked (worker and tier from its subject)."""
        return WatchedTransport(transport, self)

    @property
    def waiting(self) -> list[Waiting]:
        """The requests waiting now, oldest first."""
        return sorted(self._waiting.values(), key=lambda w: w.since)

    @contextlib.contextmanager
    def track(
        self,
        tier: str,
        worker_id: str | None,
        what: str,
        job_id: str = "",
        *,
        deadline_s: float | None = None,
    ) -> Iterator[Waiting]:
        """Track one request to ``worker_id`` of ``tier`` (None: the tier's) while the block runs;
        ``deadline_s`` (its deadline from its work) is how long a busy worker may take unreported."""
        key = next(self._ids)
        entry = self._waiting[key] = Waiting(
            tier, worker_id, what, job_id, self.clock(), deadline_s=deadline_s
        )
        self._ensure_checker()
        try:
            yield entry
        finally:
            self._waiting.pop(key, None)
            self.longest_s = max(self.longest_s, self.clock() - entry.since)

    def _ensure_checker(self) -> None:
        if self._checker is not None and not self._checker.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: check() is called by hand
        self._checker = loop.create_task(self._check_while_waiting(), name="stall-watchdog")

    async def _check_while_waiting(self) -> None:
        period = min(5.0, self.stall_report_s / 4, (self.lost_after_s or 20.0) / 4)
        while self._waiting:
            await asyncio.sleep(period)
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watchdog must not die of one report
                logger.exception("stall watchdog pass failed")

    def check(self, now: float | None = None) -> list[StallReport]:
        """Report every request due a report now (first at :meth:`first_report_s`, then each
        ``stall_report_s``)."""
        now = self.clock() if now is None else now
        made: list[StallReport] = []
        for entry in self.waiting:
            waited = now - entry.since
            self.longest_s = max(self.longest_s, waited)
            self._check_lost(entry, now)
            if waited < self.first_report_s(entry, now) + self.stall_report_s * entry.reported:
                continue
            entry.reported += 1
            report = self._report(entry, waited, now)
            made.append(report)
            self.reports.append(report)
            logger.warning("stall: %s", report.message)
            if self.on_report is not None:
                self.on_report(report)
        return made

    def first_report_s(self, entry: Waiting, now: float | None = None) -> float:
        """When ``entry`` is first a stall: at its deadline while a worker it may be on is heard from
        and busy, or has not beaten since the request was sent (its next beat tells), never before
        ``stall_report_s``; else (silent, or idle since the request) at ``stall_report_s``."""
        now = self.clock() if now is None else now
        if entry.deadline_s is None:
            return self.stall_report_s
        untold = any(
            now - w.last_seen <= self.silent_after_s and w.last_seen <= entry.since
            for w in self._workers(entry)
        )
        if untold or self.working(entry, now):
            return max(self.stall_report_s, entry.deadline_s)
        return self.stall_report_s

    def working(self, entry: Waiting, now: float | None = None) -> bool:
        """Whether a worker ``entry`` may be on is heard from and busy: its deadline is extended."""
        now = self.clock() if now is None else now
        return any(
            now - w.last_seen <= self.silent_after_s and (w.activity or w.busy) for w in self._workers(entry)
        )

    def _check_lost(self, entry: Waiting, now: float) -> None:
        """Give ``entry`` up when every worker it may be on has beaten as idle for ``lost_after_s``.

        Only beats sent after the request count (a beat from before it arrived says nothing), and
        only a worker heard within ``silent_after_s`` (a silent one is the registry's to reap).
        """
        if self.lost_after_s is None or entry.lost is None or entry.lost.done():
            return
        workers = self._workers(entry)
        idle = bool(workers) and all(
            now - w.last_seen <= self.silent_after_s
            and w.last_seen > entry.since
            and not w.activity
            and not w.busy
            for w in workers
        )
        if not idle:
            entry.idle_since = None
            return
        if entry.idle_since is None:
            entry.idle_since = now
            return
        idle_s = now - entry.idle_since
        if idle_s < self.lost_after_s:
            return
        who = entry.worker_id or ", ".join(w.worker_id for w in workers)
        job = f" job {entry.job_id}" if entry.job_id else ""
        reason = (
            f"{entry.tier} worker {who} is alive and has reported no work in progress for {idle_s:.0f} s, "
            f"but never answered {entry.what}{job} (sent {now - entry.since:.0f} s ago): its answer was "
            "lost; giving up on it"
        )
        logger.warning("lost request: %s", reason)
        entry.lost.set_result(RequestLost(entry.subject, entry.tier, now - entry.since, reason))

    def _workers(self, entry: Waiting) -> list[WorkerInfo]:
        if self.registry is None:
            return []
        if entry.worker_id is None:
            return self.registry.workers(entry.tier)
        found = self.registry.get(entry.tier, entry.worker_id)
        return [found] if found is not None else []

    def _report(self, entry: Waiting, waited: float, now: float) -> StallReport:
        job = f" job {entry.job_id}" if entry.job_id else ""
        owed = f"no result for {waited:.0f} s on {entry.what}{job}"
        workers = self._workers(entry)
        name = entry.worker_id or ", ".join(w.worker_id for w in workers)
        if not workers:
            who = f"{entry.tier} worker {entry.worker_id}" if entry.worker_id else f"the {entry.tier} tier"
            state = "has no live worker" if entry.worker_id is None else "is not in the fleet (left or dead)"
            text = f"{who} {state}; {owed}"
            return StallReport(entry.tier, name, entry.what, entry.job_id, waited, None, "", 0.0, text)
        worker = min(workers, key=lambda w: now - w.last_seen)  # the liveliest of the tier's
        heard = now - worker.last_seen
        activity_s = worker.activity_s + heard if worker.activity else 0.0
        doing = f"it reports: {worker.activity} for {activity_s:.0f} s" if worker.activity else ""
        doing = doing or "it reports no activity"
        who = f"{entry.tier} worker {worker.worker_id}"
        if heard > self.silent_after_s:
            text = f"{who} not heard for {heard:.0f} s; {owed} (last {doing})"
        else:
            text = f"{who} alive and heartbeating (last beat {heard:.0f} s ago) but {owed} ({doing})"
        named = worker.worker_id if entry.worker_id else name
        return StallReport(entry.tier, named, entry.what, entry.job_id, waited, heard, worker.activity,
                           activity_s, text)  # fmt: skip

    async def stop(self) -> None:
        """Stop the checker (it also ends by itself when nothing is waiting)."""
        checker, self._checker = self._checker, None
        if checker is not None:
            checker.cancel()
            await asyncio.gather(checker, return_exceptions=True)


def _target(subject: str) -> tuple[str, str | None]:
    """``(tier, worker_id)`` of a request subject: ``rlfleet.C.T.worker.ID`` is one worker of T,
    ``rlfleet.C.T.verb`` the tier T (worker None)."""
    parts = subject.split(".")
    if len(parts) < 4 or parts[0] != "rlfleet":
        return "", None
    if parts[3] == "worker" and len(parts) >= 5:
        return parts[2], ".".join(parts[4:])
    return parts[2], None


class WatchedTransport:
    """A transport whose requests the watchdog tracks; everything else passes through."""

    def __init__(self, transport: Transport, watchdog: Watchdog) -> None:
        self._inner = transport
        self.watchdog = watchdog

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def request(
        self,
        subject: str,
        message: Message,
        *,
        timeout: float,
        tier: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> AnyMessage:
        target_tier, worker_id = _target(subject)
        job_id = str(getattr(message, "job_id", ""))
        with self.watchdog.track(
            target_tier or tier, worker_id, message.kind, job_id, deadline_s=timeout
        ) as entry:
            entry.subject = subject
            entry.lost = asyncio.get_running_loop().create_future()
            cap = timeout * (1 + self.watchdog.max_extensions)
            asked = asyncio.ensure_future(
                self._inner.request(subject, message, timeout=cap, tier=tier, headers=headers)
            )
            deadline = entry.since + timeout
            try:
                while True:
                    left = deadline - self.watchdog.clock()
                    await asyncio.wait([asked, entry.lost], timeout=max(0.0, left),
                                       return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                    if asked.done() or entry.lost.done():
                        break
                    if self.watchdog.clock() < deadline:
                        continue
                    if not self.watchdog.working(entry):
                        raise RequestTimeout(subject, target_tier or tier, timeout)
                    deadline += timeout
                    logger.warning("%s: still working on %s job %s after %.0f s (its deadline); waiting "
                                   "up to %.0f s more (at most %.0f s in all)", entry.worker_id or entry.tier,
                                   entry.what, entry.job_id or "-", self.watchdog.clock() - entry.since,
                                   timeout, cap)  # fmt: skip
            except BaseException:
                asked.cancel()
                await asyncio.gather(asked, return_exceptions=True)
                raise
            if asked.done():
                entry.lost.cancel()
                return asked.result()
            asked.cancel()
            await asyncio.gather(asked, return_exceptions=True)
            raise entry.lost.result()
