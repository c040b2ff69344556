"""Who is in the fleet: workers announce and heartbeat, the controller keeps a registry.

Every worker runs a :class:`Heartbeater` (the worker's side, first in this file): it publishes a
:class:`WorkerAnnounce` when it starts, a :class:`Heartbeat` every ``interval`` s with a
:class:`WorkerStatus` (weight version, busy count, what it is doing) and a :class:`WorkerLeave`
when it stops, all on its tier's :func:`membership_subject`, and announces again when a
:class:`Ping` comes by on :func:`ping_subject` (as :class:`rlfleet.common.control.worker.Worker`
does). The controller runs a :class:`WorkerRegistry`
that listens on every tier's membership subject, pings on start (so a controller that joins late
learns the running workers) and drops workers that miss heartbeats for ``dead_after`` s.

Outages (issue 12): silence counts only while the registry's own connection is up. While it is
down (a nats-server restart, the loss of the cluster node it was on) nobody can be heard, so
nobody is declared dead; when it comes back, every worker not heard since gets
``dead_after + reconnect_grace`` s from that moment (workers reconnect with backoff of their own).
A heartbeat loop survives any error of a beat: a transport that is reconnecting loses a beat, any
other error is logged, and the next one goes out; only a transport closed for good ends it. A leave
that cannot be flushed (the server is gone) is logged, never raised: the worker still stops.

Forgery: the registry takes a message about tier T only from T's own membership subject (which a
role-permissioned server lets only T's role publish), and an announce only when its reply subject
is the worker's own (:func:`worker_subject`) or unset (then it is set to that), so requests (and
the tokens in their headers) never go to a subject an announce made up.

**A change to a worker is believed only from that worker** (issue 29). The workers of one role
share a credential, so a message on T's membership subject may come from any process of role T
(any worker that joined with the run's join file): one :class:`WorkerLeave` in another worker's
name used to make the controller give up that worker's work at once. The wire cannot tell who sent
a message, but one subject can: the worker's own (:func:`worker_subject`), where only the live
process under that id is subscribed. So a message that would change what the registry holds of a
known worker is checked there first, by a request (:class:`Ping`) to that subject
(:meth:`WorkerRegistry.probe`), in the background (a probe never holds up the heartbeats behind it):

- a **leave** is acted on only when nobody answers on the worker's own subject any more (``no
  responders``: a stopping worker leaves that subject before it says goodbye,
  :meth:`rlfleet.common.control.worker.Worker.stop`, as does any process that exits). A leave whose
  worker still answers is forged or stale: ignored, logged. One that is not answered in time (a
  frozen worker) is left to the heartbeats: silence past ``dead_after`` declares it dead.
- an **announce** that changes a known worker's identity (its address, incarnation, pid, host,
  capacity, pool, GPUs...; the weight version is the heartbeats' and the fleet's business) is not
  adopted as it is: the worker's own answer to the ping (its :class:`WorkerAnnounce`) is, so a
  worker restarted under its id is seen as the new process, and a forged announce changes nothing.
  A worker of an older release answers a ping on its own subject with an error (it does not know
  it): alive, but it does not say who it is; its announce is then adopted as before.

Designed this way, rather than with a per-worker identity on the wire, because it needs no new
secret, no new field and no new login: it works for workers that join a run with the shared join
file, for every launcher, and against workers of the previous release. What remains is the
shared credential itself: a process of role T may also subscribe to another T worker's own
subject (``P.T.>``), so it could answer the registry's ping in that worker's name, racing the real
one (it can make a leave be ignored, never believed: the real worker still answers). Closing that
needs a NATS user per worker allowed only its own subject (``nats_roles``; README, "Trust model").
A worker the registry declares dead is also kept (:meth:`WorkerRegistry.take_dead`) for the
run's supervisor, which has the launcher kill a frozen process and start it again
(:mod:`rlfleet.controller.supervision`).

::

    worker:  announce ──► heartbeat ──► heartbeat ──► ... ──► leave
                 ▲ (again on ping)                  (or silence ⇒ registry marks it dead)

**Wire versions** (the first section): a worker's announce carries its package and the package's
installed version (:func:`release_of`, wire 2.4) beside the ``protocol`` every message carries;
``rlfleet status`` shows both. A MINOR skew is served as usual. A worker of another MAJOR version is
refused at connect: its announce and heartbeats fail to decode
(:class:`~rlfleet.common.errors.ProtocolMismatch`, whose ``sender`` says who sent it); the registry
keeps a :class:`WireRefusal` per such worker, logs it once, tells the worker (:func:`tell_refused`: a
message on the worker's own subject, which the worker refuses in turn, naming both versions in its
own log), and ``wait_for`` raises :class:`WorkerWireRefused` at once instead of waiting for a worker
that can never join. tests/compat runs the previous release of each tier against this code.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, NamedTuple

from rlfleet.common.control.messages import (
    PROTOCOL,
    AnyMessage,
    ErrorReply,
    Heartbeat,
    Message,
    Ping,
    WorkerAnnounce,
    WorkerLeave,
)
from rlfleet.common.control.transport import (
    WORKER_TIERS,
    RefusingHandler,
    Subscription,
    Transport,
    membership_subject,
    ping_subject,
    worker_subject,
)
from rlfleet.common.errors import NoResponders, ProtocolMismatch, RemoteError, TransportClosed

logger = logging.getLogger(__name__)

# --- the wire version a worker announces: another MAJOR is refused at connect ------------------------


@functools.cache
def installed_version(package: str) -> str:
    """The installed version of ``package`` ('' when it is not installed as a distribution)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def release_of(tier: str) -> dict[str, str]:
    """A tier worker's announce fields for its release: ``rlfleet-<tier>`` and its version."""
    package = f"rlfleet-{tier}"
    return {"package": package, "package_version": installed_version(package)}


@dataclass(frozen=True)
class WireRefusal:
    """A worker refused for speaking another MAJOR wire version (what its refused message said)."""

    tier: str
    worker_id: str
    protocol: str
    pool: str = ""
    package: str = ""
    package_version: str = ""
    host: str = ""

    @classmethod
    def of(cls, tier: str, exc: ProtocolMismatch) -> WireRefusal | None:
        """The refusal of the worker that sent a message on ``tier``'s membership subject; None when
        the message does not name a worker of that tier."""
        sender = exc.sender
        worker_id = sender.get("worker_id", "")
        if sender.get("tier") != tier or not worker_id:
            return None
        return cls(tier, worker_id, str(exc.theirs)[:32], sender.get("pool", ""), sender.get("package", ""),
                   sender.get("package_version", ""), sender.get("host", ""))  # fmt: skip

    def describe(self) -> str:
        """``rollout worker rollout-0 (rlfleet-rollout 0.1.0 on host-a) speaks wire protocol 3.0``."""
        release = " ".join(part for part in (self.package, self.package_version) if part)
        where = f" on {self.host}" if self.host else ""
        return (f"{self.tier} worker {self.worker_id} ({release or 'release not announced'}{where}) "
                f"speaks wire protocol {self.protocol}")  # fmt: skip


class WorkerWireRefused(ProtocolMismatch):
    """A worker was refused at connect: it speaks another MAJOR wire version than this process."""

    def __init__(self, refusal: WireRefusal, ours: str) -> None:
        self.ours, self.theirs, self.refusal = ours, refusal.protocol, refusal
        self.sender = {"tier": refusal.tier, "worker_id": refusal.worker_id}
        common = installed_version("rlfleet-common")
        us = f"this process (rlfleet-common {common})" if common else "this process"
        super(ProtocolMismatch, self).__init__(
            f"{refusal.describe()}, but {us} speaks wire protocol {ours}: MAJOR versions must match, so "
            "it was refused at connect; run releases of the same MAJOR wire version on every tier "
            "(upgrade the older side)"
        )


async def tell_refused(transport: Transport, cluster: str, refusal: WireRefusal, ours: str) -> None:
    """Send the refused worker a message on its own subject: it cannot read it (another MAJOR
    version), and its log says so, naming both versions. Never raises: a worker id that is no
    subject token, or a connection that cannot send, is only logged."""
    try:
        subject = worker_subject(cluster, refusal.tier, refusal.worker_id)
        notice = ErrorReply(tier="controller", code="protocol_mismatch",
                            message=str(WorkerWireRefused(refusal, ours)))  # fmt: skip
        await transport.publish(subject, notice)
        await transport.flush()
    except (ValueError, ConnectionError, OSError, RuntimeError) as exc:
        logger.debug("could not tell %s worker %r of its refusal: %s", refusal.tier, refusal.worker_id, exc)


# --- the worker's side ---------------------------------------------------------------------


class WorkerStatus(NamedTuple):
    """What a heartbeat reports besides liveness."""

    weight_version: int = -1
    busy: int = 0
    activity: str = ""  # what the worker is doing now ('' when idle), e.g. "generate rollout-3f2a"
    activity_s: float = 0.0  # seconds since that activity began
    step: int = -1  # the last training step this worker did (trainer ranks; -1: none)


PING_ANSWER_INTERVAL_S = 0.5
"""The most often a worker announces because of pings: anyone who may ping (a tenant of a shared
reward server may) could otherwise make every worker broadcast as fast as it sends. A ping inside
the interval is answered by one announce at its end, for every ping that came meanwhile."""


class Heartbeater:
    """Announces a worker, heartbeats every ``interval`` s and says goodbye on stop.

    ``announce`` is the worker's announcement, or a function returning a fresh one (its weight
    version and fields at the time); ``status`` gives what each heartbeat reports. A transport that
    is reconnecting loses a beat, never the loop; only a transport closed for good ends it. Pings
    are answered at most once per ``ping_interval`` s (:data:`PING_ANSWER_INTERVAL_S`).
    """

    def __init__(
        self,
        transport: Transport,
        cluster: str,
        announce: WorkerAnnounce | Callable[[], WorkerAnnounce],
        *,
        interval: float = 2.0,
        status: Callable[[], WorkerStatus] | None = None,
        ping_interval: float = PING_ANSWER_INTERVAL_S,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0 s, got {interval}")
        self.transport = transport
        self.cluster = cluster
        self._announce = announce if callable(announce) else (lambda: announce)
        self.interval = interval
        self.status = status or (lambda: WorkerStatus(self._announce().weight_version, 0))
        self._task: asyncio.Task[None] | None = None
        self._ping_sub: Subscription | None = None
        self.ping_interval = ping_interval
        self._pinged_at = -float("inf")  # when a ping was last answered
        self._ping_due: asyncio.Task[None] | None = None  # the one announce that answers the pings waiting

    @property
    def announce(self) -> WorkerAnnounce:
        """The announcement as it stands now."""
        return self._announce()

    async def start(self) -> None:
        """Announce, listen for pings and start beating."""
        if self._task is not None:
            raise RuntimeError(f"heartbeater for {self.announce.worker_id!r} already started")
        self._ping_sub = await self.transport.subscribe(
            ping_subject(self.cluster), self._on_ping, max_concurrency=1
        )
        await self.announce_now()
        self._task = asyncio.create_task(self._beat(), name=f"heartbeat:{self.announce.worker_id}")

    async def announce_now(self) -> None:
        """Publish a :class:`WorkerAnnounce` carrying the current weight version."""
        version = self.status().weight_version
        announce = self.announce
        await self.transport.publish(
            membership_subject(self.cluster, announce.tier),
            announce.model_copy(update={"weight_version": version}),
        )

    async def _on_ping(self, message: AnyMessage) -> Message | None:
        if not isinstance(message, Ping) or self._ping_due is not None:
            return None  # an announce is due already: it answers this ping too
        wait = self._pinged_at + self.ping_interval - time.monotonic()
        if wait > 0:
            self._ping_due = asyncio.create_task(self._answer_ping(wait), name=f"ping:{self._worker_id()}")
        else:
            await self._answer_ping(0.0)
        return None

    async def _answer_ping(self, wait: float) -> None:
        await asyncio.sleep(wait)
        self._ping_due = None
        self._pinged_at = time.monotonic()
        try:
            await self.announce_now()
        except ConnectionError as exc:  # the next ping (or beat after a reconnect) tries again
            logger.warning("%s did not answer a ping: %s", self._worker_id(), exc)

    async def _beat(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self._beat_once()
                failures = 0
            except TransportClosed:
                logger.warning("heartbeat of %s stops: transport closed", self._worker_id())
                return
            except ConnectionError as exc:  # reconnecting: this beat is lost, the next one retries
                logger.warning("heartbeat of %s not sent: %s", self._worker_id(), exc)
            except Exception:  # noqa: BLE001 - no error of one beat may end the worker's liveness
                failures += 1
                log = logger.exception if failures <= 3 or failures % 100 == 0 else logger.debug
                log("heartbeat of %s failed (%d in a row); beating on", self._worker_id(), failures)

    async def _beat_once(self) -> None:
        a, now = self.announce, self.status()
        beat = Heartbeat(
            tier=a.tier, worker_id=a.worker_id, weight_version=now.weight_version, busy=now.busy,
            pool=a.pool, incarnation=a.incarnation, activity=now.activity[:256],
            activity_s=max(0.0, now.activity_s), step=max(-1, now.step),
        )  # fmt: skip
        await self.transport.publish(membership_subject(self.cluster, a.tier), beat)

    def _worker_id(self) -> str:
        try:
            return self.announce.worker_id
        except Exception:  # noqa: BLE001 - only for a log line
            return "?"

    async def stop(self, reason: str = "shutdown") -> None:
        """Stop beating and publish a :class:`WorkerLeave` (if the transport is still open)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        due, self._ping_due = self._ping_due, None
        if due is not None:
            due.cancel()
            await asyncio.gather(due, return_exceptions=True)
        if self._ping_sub is not None:
            await self._ping_sub.unsubscribe()
            self._ping_sub = None
        leave = WorkerLeave(tier=self.announce.tier, worker_id=self.announce.worker_id, reason=reason)
        try:
            await self.transport.publish(membership_subject(self.cluster, leave.tier), leave)
            await self.transport.flush()
        except (ConnectionError, TimeoutError) as exc:  # the server is gone: the flush is never answered
            logger.warning("%s left without saying so: %s", self.announce.worker_id, exc)

    async def __aenter__(self) -> Heartbeater:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


# --- the controller's side -----------------------------------------------------------------


@dataclass
class WorkerInfo:
    """What the registry knows about one live worker."""

    announce: WorkerAnnounce
    last_seen: float
    weight_version: int
    busy: int = 0
    activity: str = ""
    """What the worker's last heartbeat said it was doing ('' when idle)."""
    activity_s: float = 0.0
    """For how long, as of that heartbeat (``last_seen``)."""
    step: int = -1
    """The last training step the worker's heartbeat said it did (trainer ranks; -1: none)."""

    @property
    def tier(self) -> str:
        return self.announce.tier

    @property
    def worker_id(self) -> str:
        return self.announce.worker_id

    @property
    def pool(self) -> str:
        return self.announce.pool

    @property
    def subject(self) -> str:
        """The subject this worker alone listens on."""
        return self.announce.subject

    @property
    def data_address(self) -> str:
        return self.announce.data_address


Callback = Callable[[WorkerInfo], Awaitable[None] | None]

MAX_DEAD_KEPT = 64
"""Workers declared dead that the registry keeps until taken (:meth:`WorkerRegistry.take_dead`)."""


class Probe(NamedTuple):
    """What a worker's own subject answered to a :class:`Ping` (:meth:`WorkerRegistry.probe`).

    ``gone``: nobody is subscribed there (no responders); ``silent``: no answer in time (a frozen or
    unreachable process, or the connection down); ``alive``: an answer, ``announce`` being the
    worker's own account of itself when it gave one; ``legacy``: an error answer (a worker of an
    older release, which does not take a ping there), alive but not saying who it is.
    """

    state: Literal["gone", "silent", "alive", "legacy"]
    announce: WorkerAnnounce | None = None


def identity(announce: WorkerAnnounce) -> dict[str, object]:
    """What an announce says of its worker, except its weight version (heartbeats and the fleet's
    weight loads move that): two announces of one process's life have the same identity."""
    return announce.model_dump(exclude={"weight_version"})


class WorkerRegistry:
    """Tracks the workers of every tier from the membership subject."""

    def __init__(
        self,
        transport: Transport,
        cluster: str,
        *,
        dead_after: float = 10.0,
        reconnect_grace: float = 10.0,
        on_join: Callback | None = None,
        on_leave: Callback | None = None,
        on_dead: Callback | None = None,
        clock: Callable[[], float] = time.monotonic,
        verify: bool = True,
        probe_s: float | None = None,
    ) -> None:
        if dead_after <= 0:
            raise ValueError(f"dead_after must be > 0 s, got {dead_after}")
        if probe_s is not None and probe_s <= 0:
            raise ValueError(f"probe_s must be > 0 s, got {probe_s}")
        if reconnect_grace < 0:
            raise ValueError(f"reconnect_grace must be >= 0 s, got {reconnect_grace}")
        self.transport = transport
        self.cluster = cluster
        self.dead_after = dead_after
        self.reconnect_grace = reconnect_grace
        self.on_join, self.on_leave, self.on_dead = on_join, on_leave, on_dead
        self.clock = clock
        self.verify = verify
        """Check a leave, or an announce changing a known worker, on the worker's own subject first
        (module docstring); off only for a client that may not send requests to workers and acts on
        nothing it hears (an observer)."""
        self.probe_s = probe_s if probe_s is not None else min(5.0, dead_after / 2)
        """How long a worker's own subject has to answer a probe."""
        self._workers: dict[tuple[str, str], WorkerInfo] = {}
        self._probes: dict[tuple[str, str, str], asyncio.Task[None]] = {}  # (what, tier, id) -> its check
        self._dead: list[WorkerInfo] = []  # declared dead, not taken yet
        self._refused: dict[tuple[str, str], WireRefusal] = {}  # workers of another MAJOR wire version
        self._changed = asyncio.Event()
        self._subs: list[Subscription] = []
        self._reaper: asyncio.Task[None] | None = None
        self._pinged = -float("inf")
        self._drops = 0  # the transport's drop count at the last look
        self._offline = False  # the registry's own connection was down at the last look
        self._back_at = -float("inf")  # when it last came back

    async def start(self) -> None:
        """Listen on the membership subject, ping the workers, start dead-worker detection."""
        for tier in WORKER_TIERS:
            self._subs.append(await self.transport.subscribe(
                membership_subject(self.cluster, tier), self._listener(tier), max_concurrency=1
            ))  # fmt: skip
        await self.transport.flush()
        await self._ping()
        self._reaper = asyncio.create_task(self._reap(), name=f"registry-reaper:{self.cluster}")

    async def stop(self) -> None:
        """Stop listening."""
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)
        probes, self._probes = list(self._probes.values()), {}
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        subs, self._subs = self._subs, []
        for sub in subs:
            await sub.unsubscribe()

    async def __aenter__(self) -> WorkerRegistry:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def workers(self, tier: str, pool: str | None = None) -> list[WorkerInfo]:
        """Live workers of ``tier`` (in ``pool`` if given), by worker id."""
        found = [w for (t, _), w in self._workers.items() if t == tier and (pool is None or w.pool == pool)]
        return sorted(found, key=lambda w: w.worker_id)

    def refused(self, tier: str, pool: str | None = None) -> list[WireRefusal]:
        """Workers of ``tier`` (in ``pool`` if given) refused for another MAJOR wire version, by id."""
        found = [r for (t, _), r in self._refused.items() if t == tier and (pool is None or r.pool == pool)]
        return sorted(found, key=lambda r: r.worker_id)

    def get(self, tier: str, worker_id: str) -> WorkerInfo | None:
        """One live worker, or None."""
        return self._workers.get((tier, worker_id))

    def take_dead(self) -> list[WorkerInfo]:
        """The workers declared dead (silent past ``dead_after``) since the last call, oldest first
        (at most :data:`MAX_DEAD_KEPT`): what each was when it went silent (its pid, its host)."""
        dead, self._dead = self._dead, []
        return dead

    def forget(self, tier: str, worker_id: str) -> WorkerInfo | None:
        """Drop a worker known to be gone (its launcher saw the process exit) without waiting
        ``dead_after``, so that its next announce is a join; returns what was known of it, or None.
        No callback runs: the caller knows already."""
        info = self._workers.pop((tier, worker_id), None)
        if info is not None:
            self._changed.set()
        return info

    async def wait_for(
        self, tier: str, count: int, timeout: float, *, pool: str | None = None
    ) -> list[WorkerInfo]:
        """Wait until ``count`` workers of ``tier`` are live and return all live ones.

        Raises ``TimeoutError`` naming the tier, the count asked for and the workers that came, and
        :class:`WorkerWireRefused` at once when one of the tier's workers speaks another MAJOR
        wire version (it can never join).
        """
        deadline = asyncio.get_running_loop().time() + timeout
        while len(found := self.workers(tier, pool)) < count:
            if refused := self.refused(tier, pool):
                raise WorkerWireRefused(refused[0], PROTOCOL)
            self._changed.clear()
            left = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(self._changed.wait(), max(left, 0.0))
            except TimeoutError:
                found = self.workers(tier, pool)
                if len(found) >= count:
                    break
                where = f" in pool {pool!r}" if pool is not None else ""
                ids = ", ".join(w.worker_id for w in found) or "none"
                raise TimeoutError(
                    f"waited {timeout:g}s for {count} {tier} worker(s){where} on cluster {self.cluster!r}; "
                    f"{len(found)} arrived ({ids}). Are the {tier} workers started and pointed at this "
                    "NATS server and cluster name?"
                ) from None
        return found

    def _listener(self, tier: str) -> RefusingHandler:
        """The handler of ``tier``'s membership subject: messages about another tier are refused,
        and so are those of another MAJOR wire version (:meth:`_on_refused`)."""

        async def on_message(message: AnyMessage) -> Message | None:
            claimed = getattr(message, "tier", None)
            if claimed != tier:
                logger.warning("membership of %s: ignored a %s claiming tier %r", tier,
                               getattr(message, "kind", "?"), claimed)  # fmt: skip
                return None
            if isinstance(message, WorkerAnnounce):
                valid = _token(message.worker_id)
                own = worker_subject(self.cluster, tier, message.worker_id) if valid else ""
                if not own or message.subject not in ("", own):
                    logger.warning("ignored the announce of %s worker %r: its subject %r is not its own",
                                   tier, message.worker_id[:64], message.subject[:128])  # fmt: skip
                    return None
                message = message.model_copy(update={"subject": own})  # requests go there, never elsewhere
            return await self._on_message(message)

        return RefusingHandler(on_message, partial(self._on_refused, tier))

    async def _on_refused(self, tier: str, exc: ProtocolMismatch) -> None:
        """A membership message of another MAJOR wire version: note its worker (once), tell it."""
        refusal = WireRefusal.of(tier, exc)
        if refusal is None or (tier, refusal.worker_id) in self._refused:
            return
        self._refused[(tier, refusal.worker_id)] = refusal
        logger.error("%s", WorkerWireRefused(refusal, PROTOCOL))
        self._changed.set()
        await tell_refused(self.transport, self.cluster, refusal, PROTOCOL)

    async def _on_message(self, message: AnyMessage) -> Message | None:
        now = self.clock()
        if isinstance(message, WorkerAnnounce):
            await self._on_announce(message, now)
        elif isinstance(message, Heartbeat):
            info = self._workers.get((message.tier, message.worker_id))
            if info is None:
                await self._ping()  # a worker we missed or declared dead: ask again
            else:
                info.last_seen, info.weight_version, info.busy = now, message.weight_version, message.busy
                info.activity, info.activity_s, info.step = message.activity, message.activity_s, message.step
        elif isinstance(message, WorkerLeave):
            info = self._workers.get((message.tier, message.worker_id))
            if info is not None and self.verify:
                self._check_later("leave", info, self._verify_leave(info, message.reason))
            elif info is not None:
                await self._left(info, message.reason)
        return None

    async def _left(self, info: WorkerInfo, reason: str) -> None:
        if self._workers.get((info.tier, info.worker_id)) is not info:
            return
        del self._workers[(info.tier, info.worker_id)]
        logger.info("%s worker %s left (%s)", info.tier, info.worker_id, reason or "no reason")
        self._changed.set()
        await self._call(self.on_leave, info)

    async def _on_announce(self, message: WorkerAnnounce, now: float) -> None:
        key = (message.tier, message.worker_id)
        self._refused.pop(key, None)  # restarted with a release of our MAJOR version
        info = self._workers.get(key)
        if info is not None and self.verify and identity(message) != identity(info.announce):
            self._check_later("announce", info, self._verify_announce(info, message))
            return
        if info is not None:
            info.announce, info.last_seen, info.weight_version = message, now, message.weight_version
            return
        info = WorkerInfo(announce=message, last_seen=now, weight_version=message.weight_version)
        self._workers[key] = info
        release = " ".join(p for p in (message.package, message.package_version) if p)
        logger.info("%s worker %s joined (pool %s, %s, wire %s)", info.tier, info.worker_id, info.pool,
                    release or "release not announced", message.protocol)  # fmt: skip
        self._changed.set()
        await self._call(self.on_join, info)

    # --- a change to a worker, checked with the worker itself (module docstring) -----------------

    async def probe(self, tier: str, worker_id: str) -> Probe:
        """Ask ``worker_id``'s own subject who is there (a :class:`Ping`, ``probe_s`` to answer)."""
        own = worker_subject(self.cluster, tier, worker_id)
        try:
            reply = await self.transport.request(own, Ping(), timeout=self.probe_s, tier=tier)
        except NoResponders:
            return Probe("gone")
        except RemoteError:
            return Probe("legacy")
        except (TimeoutError, ConnectionError) as exc:  # no answer in time; our connection is down
            logger.debug("probe of %s worker %s: %s", tier, worker_id, exc)
            return Probe("silent")
        if isinstance(reply, WorkerAnnounce) and (reply.tier, reply.worker_id) == (tier, worker_id):
            return Probe("alive", reply.model_copy(update={"subject": own}))
        return Probe("alive")

    def _check_later(self, what: str, info: WorkerInfo, check: Coroutine[Any, Any, None]) -> None:
        """Run ``check`` in the background, one at a time per worker and kind of change (another
        message of that kind while one runs is dropped: the check asks the worker itself anyway)."""
        key = (what, info.tier, info.worker_id)
        running = self._probes.get(key)
        if running is not None and not running.done():
            check.close()
            return
        task = asyncio.create_task(check, name=f"membership-{what}:{info.tier}:{info.worker_id}")
        self._probes[key] = task
        task.add_done_callback(lambda done: self._probed(key, done))

    def _probed(self, key: tuple[str, str, str], task: asyncio.Task[None]) -> None:
        if self._probes.get(key) is task:
            del self._probes[key]
        if not task.cancelled() and task.exception() is not None:
            logger.error("membership check %s failed", key, exc_info=task.exception())

    async def _verify_leave(self, info: WorkerInfo, reason: str) -> None:
        """Act on a leave of ``info`` only once nobody answers on its own subject."""
        answer = await self.probe(info.tier, info.worker_id)
        if self._workers.get((info.tier, info.worker_id)) is not info:
            return  # forgotten, declared dead or replaced meanwhile
        if answer.state == "gone":
            await self._left(info, reason)
        elif answer.state == "silent":
            logger.warning("a leave of %s worker %s (%s) is not acted on: its own subject did not answer in "
                           "%.1fs; its heartbeats decide (dead after %.1fs of silence)", info.tier,
                           info.worker_id, reason or "no reason", self.probe_s, self.dead_after)  # fmt: skip
        else:
            logger.warning("ignored a leave of %s worker %s (%s): the worker still answers on its own "
                           "subject (a forged or stale leave)", info.tier, info.worker_id,
                           reason[:64] or "no reason")  # fmt: skip

    async def _verify_announce(self, info: WorkerInfo, message: WorkerAnnounce) -> None:
        """Adopt what ``info``'s worker says of itself on its own subject, not what ``message`` says."""
        answer = await self.probe(info.tier, info.worker_id)
        if self._workers.get((info.tier, info.worker_id)) is not info:
            return
        own = message if answer.state == "legacy" else answer.announce  # an older release: as before
        if own is None:
            there = "has nobody" if answer.state == "gone" else "did not say who is there"
            logger.warning("ignored an announce of %s worker %s that changes it: its own subject %s",
                           info.tier, info.worker_id, there)  # fmt: skip
            return
        if own is not message and identity(own) != identity(message):
            logger.warning("ignored an announce of %s worker %s that differs from what the worker says of "
                           "itself (a forged or stale announce)", info.tier, info.worker_id)  # fmt: skip
        if identity(own) != identity(info.announce):
            before = info.announce
            logger.warning("%s worker %s is another process now (incarnation %s -> %s, pid %d -> %d)",
                           info.tier, info.worker_id, before.incarnation or "?", own.incarnation or "?",
                           before.pid, own.pid)  # fmt: skip
        info.announce, info.last_seen, info.weight_version = own, self.clock(), own.weight_version

    async def _ping(self) -> None:
        now = self.clock()
        if now - self._pinged < self.dead_after / 4:
            return  # one ping brings every worker; do not flood the fleet
        self._pinged = now
        await self.transport.publish(ping_subject(self.cluster), Ping())

    @property
    def online(self) -> bool:
        """Whether the registry's own connection is up (a transport that cannot tell: always)."""
        return bool(getattr(self.transport, "is_connected", True))

    def _connection_back(self, now: float) -> bool:
        """Look at the connection: False while it is down; on the first look after it came back
        (or after a drop too short to be seen down), start the grace and ping the workers."""
        drops = int(getattr(self.transport, "drops", 0))
        if not self.online:
            if not self._offline:
                logger.warning("membership of cluster %s: NATS connection down; no worker is declared dead "
                               "until it is back", self.cluster)  # fmt: skip
            self._offline, self._drops = True, drops
            return False
        if self._offline or drops != self._drops:
            self._offline, self._drops, self._back_at = False, drops, now
            self._pinged = -float("inf")
            logger.info("membership of cluster %s: NATS connection back; workers have %.1fs to be heard",
                        self.cluster, self.dead_after + self.reconnect_grace)  # fmt: skip
            return True
        return False

    def silent_for(self, info: WorkerInfo, now: float | None = None) -> float:
        """Seconds of silence that count against ``info``: since its last heartbeat, or since the
        registry's connection came back when that is later (an outage is nobody's silence)."""
        now = self.clock() if now is None else now
        return now - max(info.last_seen, self._back_at)

    def _allowed(self, info: WorkerInfo) -> float:
        """The silence ``info`` may keep: ``dead_after``, plus the grace when not heard since the
        registry's connection came back."""
        return self.dead_after + (self.reconnect_grace if info.last_seen < self._back_at else 0.0)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(self.dead_after / 4, 1.0))
            try:
                await self._reap_once()
            except Exception:  # noqa: BLE001 - dead-worker detection must go on
                logger.exception("membership of cluster %s: a reaper pass failed", self.cluster)

    async def _reap_once(self) -> None:
        now = self.clock()
        if self._connection_back(now):
            await self._ping_quietly()
        if self._offline:
            return
        dead = [k for k, w in self._workers.items() if self.silent_for(w, now) > self._allowed(w)]
        for key in dead:
            info = self._workers.pop(key)
            logger.warning("%s worker %s is dead: no heartbeat for %.1fs (NATS connection up)", info.tier,
                           info.worker_id, now - info.last_seen)  # fmt: skip
            self._dead = [*self._dead, info][-MAX_DEAD_KEPT:]
            self._changed.set()
            await self._call(self.on_dead, info)

    async def _ping_quietly(self) -> None:
        try:
            await self._ping()
        except ConnectionError as exc:
            logger.warning("membership of cluster %s: ping not sent: %s", self.cluster, exc)

    async def _call(self, callback: Callback | None, info: WorkerInfo) -> None:
        if callback is None:
            return
        try:
            result = callback(info)
            if inspect.isawaitable(result):
                await result
        except Exception:  # noqa: BLE001 - a user callback must not stop membership tracking
            logger.exception("membership callback %r failed for worker %s", callback, info.worker_id)


def _token(worker_id: str) -> bool:
    """Whether ``worker_id`` can be one token of a subject (else no subject is its own)."""
    try:
        worker_subject("c", "rollout", worker_id)
    except ValueError:
        return False
    return True
