"""The stall watchdog on a real nats-server (issue 12, point 6): a worker that owes a result is named.

A worker that heartbeats (saying what it does) but sits on a request is reported once the
request's deadline passes (not before: a request within its deadline is work, not a stall) as alive
and heartbeating, with the job and its activity; one that also stops heartbeating is reported as not
heard from within ``stall_report_s``; a tier request nobody serves says the tier has no
live worker. The requests themselves go on: the watchdog names, it does not cancel.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import Heartbeater, WorkerRegistry, WorkerStatus
from rlfleet.common.control.messages import Ack, AnyMessage, GenerateRequest, Message, WorkerAnnounce
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject, worker_subject
from rlfleet.common.errors import NoResponders
from rlfleet.controller.watchdog import StallReport, Watchdog

CLUSTER = "wd"


@pytest.fixture
async def nats() -> AsyncIterator[EmbeddedNats]:
    server = EmbeddedNats(jetstream=False).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(40)
async def test_a_heartbeating_worker_sitting_on_a_job_is_named_with_its_activity_then_a_silent_one(
    nats: EmbeddedNats,
) -> None:
    reports: list[tuple[float, StallReport]] = []
    control = await NatsTransport.connect(nats.url, name="controller", tier="controller")
    worker = await NatsTransport.connect(nats.url, name="rollout-1", tier="rollout")
    registry = WorkerRegistry(control, CLUSTER, dead_after=30.0)
    watchdog = Watchdog(1.0, registry=registry, silent_after_s=1.0,
                        on_report=lambda r: reports.append((time.monotonic(), r)))  # fmt: skip
    release = asyncio.Event()
    started: dict[str, float] = {}

    async def generate(message: AnyMessage) -> Message | None:
        assert isinstance(message, GenerateRequest)
        started[message.job_id] = time.monotonic()
        await release.wait()  # a hung engine
        return Ack(detail="done")

    def status() -> WorkerStatus:
        job = next(iter(started), "")
        return WorkerStatus(busy=len(started), activity=f"generate {job}" if job else "",
                            activity_s=time.monotonic() - started[job] if job else 0.0)  # fmt: skip

    announce = WorkerAnnounce(tier="rollout", worker_id="rollout-1",
                              subject=worker_subject(CLUSTER, "rollout", "rollout-1"))  # fmt: skip
    beat = Heartbeater(worker, CLUSTER, announce, interval=0.2, status=status)
    try:
        await registry.start()
        await worker.subscribe(announce.subject, generate)
        await beat.start()
        await registry.wait_for("rollout", 1, 10.0)
        watched = watchdog.watch(control)
        sent = time.monotonic()
        job = GenerateRequest(job_id="job-7", prompt_token_ids=[[1]])
        request = asyncio.ensure_future(watched.request(announce.subject, job, timeout=3.0, tier="rollout"))
        while not reports:
            await asyncio.sleep(0.05)
            assert time.monotonic() - sent < 6.0, "no stall report within 3 s of the request's 3 s deadline"
        at, first = reports[0]
        assert 3.0 <= at - sent < 5.0, "a busy worker is reported at its request's deadline, not before"
        assert first.worker_id == "rollout-1" and first.job_id == "job-7" and first.heard_s is not None
        text = first.message
        assert "rollout worker rollout-1 alive and heartbeating" in text
        assert "no result for 3 s on rollout.generate job job-7" in text
        assert "it reports: generate job-7" in text, text

        # the worker's heartbeats stop too (its loop hangs): the next report says so
        task = beat._task
        assert task is not None
        task.cancel()
        while not any("not heard for" in r.message for _, r in reports):
            await asyncio.sleep(0.05)
            assert time.monotonic() - sent < 10.0, [r.message for _, r in reports]
        assert not request.done(), "the watchdog names a stall, it does not end the request"
        release.set()
        assert isinstance(await request, Ack)
        assert watchdog.waiting == [] and watchdog.longest_s >= 2.0
    finally:
        release.set()
        await registry.stop()
        await worker.close()
        await control.close()


@pytest.mark.timeout(30)
async def test_a_tier_request_nobody_answers_is_reported_as_no_live_worker(nats: EmbeddedNats) -> None:
    control = await NatsTransport.connect(nats.url, name="controller", tier="controller")
    trainer = await NatsTransport.connect(nats.url, name="trainer", tier="trainer")
    registry = WorkerRegistry(control, CLUSTER, dead_after=30.0)
    watchdog = Watchdog(0.5, registry=registry)
    release = asyncio.Event()

    async def step(message: AnyMessage) -> Message | None:
        await release.wait()
        return Ack()

    try:
        await registry.start()
        await trainer.subscribe(subject(CLUSTER, "trainer", "step"), step)  # serves, never announced
        watched = watchdog.watch(control)
        job = GenerateRequest(job_id="s-1", prompt_token_ids=[])
        request = asyncio.ensure_future(
            watched.request(subject(CLUSTER, "trainer", "step"), job, timeout=20.0)
        )
        deadline = time.monotonic() + 5.0
        while not watchdog.reports:
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline
        assert watchdog.reports[0].message.startswith("the trainer tier has no live worker; no result for")
        assert "job s-1" in watchdog.reports[0].message
        release.set()
        await request
        with pytest.raises(NoResponders):  # errors pass through the watched transport unchanged
            await watched.request(subject(CLUSTER, "reward", "score"), job, timeout=2.0)
    finally:
        release.set()
        await registry.stop()
        await trainer.close()
        await control.close()
