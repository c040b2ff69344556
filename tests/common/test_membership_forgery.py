"""A change to a worker is believed only from that worker (issue 29, point 1), on the in-process transport.

Real :class:`Worker` s and a :class:`WorkerRegistry`; a forger with its own connection publishes on
the membership subject as another process of the same role could. A leave in a live worker's name
is ignored, the worker's own leave believed at once; an announce that changes a known worker is
replaced by what the worker says of itself on its own subject (a forged one changes nothing, a
worker restarted under its id is adopted as the new process); a leave nobody answers for is left to
the heartbeats, and a worker of an older release (an error answer) is trusted as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest

from rlfleet.common.control.inproc_transport import InProcessBroker, InProcessTransport
from rlfleet.common.control.membership import Heartbeater, WorkerInfo, WorkerRegistry
from rlfleet.common.control.messages import AnyMessage, Message, WorkerAnnounce, WorkerLeave
from rlfleet.common.control.transport import membership_subject, worker_subject
from rlfleet.common.control.worker import Worker
from rlfleet.common.errors import WrongMessageKind
from rlfleet.common.schema.worker import FleetAddress, ServiceConfig

CLUSTER = "forgery"
pytestmark = pytest.mark.timeout(30)


class RolloutStandIn(Worker[ServiceConfig]):
    tier = "rollout"

    def announce_fields(self) -> dict[str, object]:
        return {"data_address": f"127.0.0.1:{5000 + len(self.worker_id)}"}


async def _worker(broker: InProcessBroker, worker_id: str) -> RolloutStandIn:
    config = ServiceConfig(fleet=FleetAddress(nats_url="inproc://", cluster=CLUSTER), worker_id=worker_id,
                           heartbeat_s=0.1, drain_s=0.5)  # fmt: skip
    worker = RolloutStandIn(config, InProcessTransport(broker, tier="rollout", name=worker_id))
    await worker.start()
    return worker


async def _until(check: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _forge(broker: InProcessBroker, message: Message) -> None:
    forger = InProcessTransport(broker, tier="rollout", name="forger")
    await forger.publish(membership_subject(CLUSTER, "rollout"), message)
    await asyncio.sleep(0.3)  # the registry's check of it is done well within this
    await forger.close()


def _registry(broker: InProcessBroker, gone: list[str], dead_after: float = 10.0) -> WorkerRegistry:
    def record(info: WorkerInfo) -> None:
        gone.append(info.worker_id)

    return WorkerRegistry(InProcessTransport(broker, name="controller"), CLUSTER, dead_after=dead_after,
                          probe_s=0.2, on_leave=record, on_dead=record)  # fmt: skip


async def test_a_forged_leave_is_ignored_and_the_workers_own_leave_is_believed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker, gone = InProcessBroker(), []
    async with _registry(broker, gone) as registry:
        worker = await _worker(broker, "rollout-0")
        await registry.wait_for("rollout", 1, timeout=5)
        with caplog.at_level(logging.WARNING):
            await _forge(broker, WorkerLeave(tier="rollout", worker_id="rollout-0", reason="forged"))
        assert registry.get("rollout", "rollout-0") is not None and gone == []
        assert "ignored a leave of rollout worker rollout-0 (forged)" in caplog.text
        started = time.monotonic()
        await worker.stop("drained")
        await _until(lambda: registry.get("rollout", "rollout-0") is None, "the real leave")
        assert gone == ["rollout-0"] and time.monotonic() - started < 2.0, "a leave, not dead_after"


async def test_a_changed_announce_is_taken_from_the_worker_itself() -> None:
    broker, gone = InProcessBroker(), []
    async with _registry(broker, gone) as registry:
        worker = await _worker(broker, "rollout-0")
        [real] = await registry.wait_for("rollout", 1, timeout=5)
        first = real.announce
        forged = first.model_copy(
            update={"incarnation": "forged", "data_address": "10.6.6.6:1", "capacity": 64}
        )
        await _forge(broker, forged)
        assert registry.get("rollout", "rollout-0").announce == first, "the forged announce changed nothing"

        await worker.transport.close()  # killed: no leave; a new process comes up under its id
        again = await _worker(broker, "rollout-0")
        await _until(lambda: registry.get("rollout", "rollout-0").announce.incarnation == again.incarnation,
                     "the restarted worker adopted")  # fmt: skip
        assert again.incarnation != first.incarnation and gone == []
        assert registry.get("rollout", "rollout-0").subject == worker_subject(CLUSTER, "rollout", "rollout-0")
        await again.stop()


async def test_a_leave_nobody_answers_for_is_left_to_the_heartbeats() -> None:
    broker, gone = InProcessBroker(), []
    async with _registry(broker, gone, dead_after=1.0) as registry:
        frozen = InProcessTransport(broker, tier="rollout", name="frozen")

        async def never(message: AnyMessage) -> None:
            await asyncio.sleep(3600)

        await frozen.subscribe(worker_subject(CLUSTER, "rollout", "rollout-0"), never)
        beats = Heartbeater(frozen, CLUSTER, WorkerAnnounce(tier="rollout", worker_id="rollout-0", pid=42),
                            interval=0.1)  # fmt: skip
        await beats.start()
        await registry.wait_for("rollout", 1, timeout=5)
        await _forge(broker, WorkerLeave(tier="rollout", worker_id="rollout-0"))
        assert registry.get("rollout", "rollout-0") is not None and gone == [], (
            "an unanswered leave is no leave"
        )
        assert registry.take_dead() == []
        beats._task.cancel()  # frozen: no more beats (and no leave)
        await _until(lambda: gone == ["rollout-0"], "declared dead", timeout=5)
        [dead] = registry.take_dead()
        assert (dead.worker_id, dead.announce.pid) == ("rollout-0", 42) and registry.take_dead() == []
        await frozen.close()


async def test_a_worker_of_an_older_release_is_trusted_as_before() -> None:
    broker, gone = InProcessBroker(), []
    async with _registry(broker, gone) as registry:
        old = InProcessTransport(broker, tier="rollout", name="old")

        async def refuse(message: AnyMessage) -> None:  # an older worker knows no ping on its own subject
            raise WrongMessageKind("rollout worker rollout-0", message.kind)

        own = await old.subscribe(worker_subject(CLUSTER, "rollout", "rollout-0"), refuse)
        await old.publish(membership_subject(CLUSTER, "rollout"), WorkerAnnounce(tier="rollout",
                          worker_id="rollout-0", incarnation="a"))  # fmt: skip
        await registry.wait_for("rollout", 1, timeout=5)
        await old.publish(membership_subject(CLUSTER, "rollout"), WorkerAnnounce(tier="rollout",
                          worker_id="rollout-0", incarnation="b"))  # fmt: skip
        await _until(lambda: registry.get("rollout", "rollout-0").announce.incarnation == "b", "adopted")
        await old.publish(
            membership_subject(CLUSTER, "rollout"), WorkerLeave(tier="rollout", worker_id="rollout-0")
        )
        await asyncio.sleep(0.3)
        assert gone == [], "it still answers on its own subject: its leave waits for its silence"
        await own.unsubscribe()
        await old.publish(
            membership_subject(CLUSTER, "rollout"), WorkerLeave(tier="rollout", worker_id="rollout-0")
        )
        await _until(lambda: gone == ["rollout-0"], "its leave once nobody answers")
        await old.close()
