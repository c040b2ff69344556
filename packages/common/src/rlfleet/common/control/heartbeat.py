"""A worker's side of membership: :class:`Heartbeater` announces it, beats every ``interval`` s with
a :class:`WorkerStatus` (weight version, busy count, what it is doing) and says goodbye on stop.

Outages (issue 12): a transport that is reconnecting loses a beat, never the loop; any error of
one beat is logged and the next one goes out; only a transport closed for good ends it. A leave
that cannot be flushed (the server is gone) is logged, never raised: the worker still stops.
The controller's side, :class:`~rlfleet.common.control.membership.WorkerRegistry`, is next door.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NamedTuple

from rlfleet.common.control.messages import AnyMessage, Heartbeat, Message, Ping, WorkerAnnounce, WorkerLeave
from rlfleet.common.control.transport import Subscription, Transport, membership_subject, ping_subject
from rlfleet.common.errors import TransportClosed

logger = logging.getLogger(__name__)


class WorkerStatus(NamedTuple):
    """What a heartbeat reports besides liveness."""

    weight_version: int = -1
    busy: int = 0
    activity: str = ""  # what the worker is doing now ('' when idle), e.g. "generate rollout-3f2a"
    activity_s: float = 0.0  # seconds since that activity began
    step: int = -1  # the last training step this worker did (trainer ranks; -1: none)


class Heartbeater:
    """Announces a worker, heartbeats every ``interval`` s and says goodbye on stop.

    ``announce`` is the worker's announcement, or a function returning a fresh one (its weight
    version and fields at the time); ``status`` gives what each heartbeat reports. A transport that
    is reconnecting loses a beat, never the loop; only a transport closed for good ends it.
    """

    def __init__(
        self,
        transport: Transport,
        cluster: str,
        announce: WorkerAnnounce | Callable[[], WorkerAnnounce],
        *,
        interval: float = 2.0,
        status: Callable[[], WorkerStatus] | None = None,
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
        if isinstance(message, Ping):
            try:
                await self.announce_now()
            except ConnectionError as exc:  # the next ping (or beat after a reconnect) tries again
                logger.warning("%s did not answer a ping: %s", self._worker_id(), exc)
        return None

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
