"""NATS outages against a real nats-server (issue 12, point 4): nobody is reaped for an outage.

The registry counts a worker's silence only while its own connection is up; after a restart of
the server on the same port every worker gets ``dead_after + reconnect_grace`` to be heard, and a
worker that really went silent is still declared dead. A request whose reply was lost in the
outage is sent again when the connection returns; one on a connection that never returns fails
after ``outage_grace_s`` with a named error. A heartbeat loop survives errors of its own beats.
In a 3-node NATS cluster a client on a stopped node fails over to another node unreaped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats, free_port
from rlfleet.common.control.membership import Heartbeater, WorkerInfo, WorkerRegistry, WorkerStatus
from rlfleet.common.control.messages import Ack, AnyMessage, GenerateRequest, Message, WorkerAnnounce
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import worker_subject
from rlfleet.common.errors import NatsServerError

CLUSTER = "outage"
FAST = dict(reconnect_time_wait=0.1, reconnect_max_wait=0.3, connect_timeout=2.0)


async def _connect(url: str, name: str, tier: str = "rollout", **options: object) -> NatsTransport:
    return await NatsTransport.connect(url, name=name, tier=tier, **{**FAST, **options})  # type: ignore[arg-type]


def _announce(worker_id: str) -> WorkerAnnounce:
    return WorkerAnnounce(
        tier="rollout", worker_id=worker_id, subject=worker_subject(CLUSTER, "rollout", worker_id)
    )


async def _until(check, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
async def server() -> AsyncIterator[EmbeddedNats]:
    nats = EmbeddedNats(jetstream=False).start()
    try:
        yield nats
    finally:
        nats.stop()


def cluster_nodes(count: int) -> list[EmbeddedNats]:
    """``count`` nats-servers (not started) that form one NATS cluster, each routed to the others."""
    ports = [free_port() for _ in range(count)]
    routes = [f"nats://127.0.0.1:{p}" for p in ports]
    return [EmbeddedNats(jetstream=False, cluster_port=p, routes=[r for r in routes if r != route])
            for p, route in zip(ports, routes, strict=True)]  # fmt: skip


async def _outage(nats: EmbeddedNats, seconds: float) -> None:
    """Stop the server, keep it down ``seconds``, start it again on the same port."""
    await asyncio.to_thread(nats.stop, keep_port=True)
    await asyncio.sleep(seconds)
    await asyncio.to_thread(nats.start)


@pytest.mark.timeout(60)
async def test_an_outage_longer_than_dead_after_reaps_nobody_and_silence_after_it_still_does(
    server: EmbeddedNats,
) -> None:
    dead: list[str] = []
    control = await _connect(server.url, "controller", tier="controller")
    registry = WorkerRegistry(control, CLUSTER, dead_after=1.0, reconnect_grace=1.5,
                              on_dead=lambda info: dead.append(info.worker_id))  # fmt: skip
    workers = [await _connect(server.url, f"w{i}") for i in range(2)]
    beats = [Heartbeater(t, CLUSTER, _announce(f"w{i}"), interval=0.2) for i, t in enumerate(workers)]
    try:
        await registry.start()
        for beat in beats:
            await beat.start()
        await registry.wait_for("rollout", 2, 10.0)

        await _outage(server, 3.0)  # three times dead_after
        await _until(lambda: control.is_connected and all(t.is_connected for t in workers), 15, "reconnects")
        await asyncio.sleep(1.0)  # beats flow again
        assert dead == [], "an outage of the registry's own connection reaped live workers"
        assert [w.worker_id for w in registry.workers("rollout")] == ["w0", "w1"]
        assert control.drops == 1

        # a worker that goes silent while the connection is up is still declared dead
        task = beats[1]._task
        assert task is not None
        task.cancel()  # no leave: silence
        await _until(lambda: dead == ["w1"], 10, "w1 declared dead")
        assert [w.worker_id for w in registry.workers("rollout")] == ["w0"]
    finally:
        await beats[0].stop()
        await registry.stop()
        for transport in [*workers, control]:
            await transport.close()


@pytest.mark.timeout(60)
async def test_a_request_whose_reply_was_lost_in_an_outage_is_sent_again_when_the_connection_returns(
    server: EmbeddedNats,
) -> None:
    calls: list[float] = []
    outage: asyncio.Task[None] | None = None

    async def slow_worker(message: AnyMessage) -> Message | None:
        calls.append(time.monotonic())
        if len(calls) == 1:  # the first answer is sent while the asker is cut off: it is lost
            nonlocal outage
            outage = asyncio.create_task(_outage(server, 3.0))
            await asyncio.sleep(1.0)
        return Ack(detail=f"answer {len(calls)}")

    # the asker reconnects slowly (2 s backoff), the worker fast: the worker's reply, flushed when
    # it is back, finds nobody subscribed to the asker's inbox
    slow = dict(reconnect_time_wait=2.0, reconnect_max_wait=2.0, reconnect_jitter=0.0)
    asker = await _connect(server.url, "asker", tier="controller", **slow)
    worker = await _connect(server.url, "worker")
    try:
        await worker.subscribe(worker_subject(CLUSTER, "rollout", "w0"), slow_worker)
        request = GenerateRequest(job_id="job-1", prompt_token_ids=[[1, 2]])
        started = time.monotonic()
        reply = await asker.request(worker_subject(CLUSTER, "rollout", "w0"), request, timeout=30.0)
        took = time.monotonic() - started
        assert isinstance(reply, Ack)
        assert len(calls) == 2 and reply.detail == "answer 2", "sent again after the reconnect"
        assert took < 15.0, f"the step resumed only after {took:.1f}s"
        assert asker.drops == 1
    finally:
        if outage is not None:
            await outage
        await asker.close()
        await worker.close()


@pytest.mark.timeout(30)
async def test_a_request_on_a_connection_down_past_the_outage_grace_fails_naming_it(
    server: EmbeddedNats,
) -> None:
    asker = await _connect(server.url, "asker", tier="controller", outage_grace_s=1.0)
    worker = await _connect(server.url, "worker")
    try:
        never = asyncio.Event()

        async def hang(message: AnyMessage) -> Message | None:
            await never.wait()
            return None

        await worker.subscribe(worker_subject(CLUSTER, "rollout", "w0"), hang)
        request = asyncio.ensure_future(
            asker.request(
                worker_subject(CLUSTER, "rollout", "w0"),
                GenerateRequest(job_id="j", prompt_token_ids=[]),
                timeout=60.0,
                tier="rollout",
            )  # fmt: skip
        )
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await asyncio.to_thread(server.stop)
        with pytest.raises(NatsServerError) as caught:
            await request
        assert time.monotonic() - started < 5.0
        text = str(caught.value)
        assert "has been down for" in text and "outage_grace_s 1" in text and server.host in text
    finally:
        await asker.close()
        await worker.close()


@pytest.mark.timeout(30)
async def test_a_heartbeat_loop_survives_an_error_of_its_own(server: EmbeddedNats) -> None:
    control = await _connect(server.url, "controller", tier="controller")
    transport = await _connect(server.url, "w0")
    registry = WorkerRegistry(control, CLUSTER, dead_after=5.0)
    seen: list[int] = []
    calls = 0

    def status() -> WorkerStatus:
        nonlocal calls
        calls += 1
        if calls in (2, 3):  # the announce is call 1; then two beats fail with an unmapped error
            raise RuntimeError("boom from a status callback")
        return WorkerStatus(weight_version=calls, activity="generate job-9", activity_s=1.5)

    beat = Heartbeater(transport, CLUSTER, _announce("w0"), interval=0.1, status=status)
    try:
        await registry.start()
        await beat.start()
        [info] = await registry.wait_for("rollout", 1, 5.0)

        def beating() -> bool:
            seen.append(info.weight_version)
            return info.weight_version > 4

        await _until(beating, 5.0, "beats after the failures")
        assert info.activity == "generate job-9" and info.activity_s == 1.5
    finally:
        await beat.stop()
        await registry.stop()
        await transport.close()
        await control.close()


@pytest.mark.timeout(60)
async def test_a_worker_on_a_stopped_cluster_node_fails_over_and_is_not_reaped() -> None:
    nodes = cluster_nodes(3)
    dead: list[WorkerInfo] = []
    try:
        for node in nodes:
            node.start()
        urls = [node.url for node in nodes]
        control = await _connect(urls[0], "controller", tier="controller")
        # the worker knows nodes 1 and 2; the one it is on is stopped
        worker = await _connect(",".join([urls[1], urls[2]]), "w0")
        registry = WorkerRegistry(control, CLUSTER, dead_after=2.0, on_dead=dead.append)
        beat = Heartbeater(worker, CLUSTER, _announce("w0"), interval=0.2)
        await registry.start()
        await _until(lambda: worker.client.connected_url is not None, 5, "worker connected")
        on = next(n for n in nodes if n.port == worker.client.connected_url.port)  # type: ignore[union-attr]
        await beat.start()
        await registry.wait_for("rollout", 1, 10.0)

        stopped = on.port
        await asyncio.to_thread(on.stop)
        await _until(lambda: worker.is_connected and worker.drops == 1, 10, "fail-over")
        assert worker.client.connected_url.port != stopped  # type: ignore[union-attr]
        [info] = registry.workers("rollout")
        heard = info.last_seen
        await _until(lambda: info.last_seen > heard + 0.5, 10, "beats through another node")
        await asyncio.sleep(2.5)  # longer than dead_after
        assert dead == [] and [w.worker_id for w in registry.workers("rollout")] == ["w0"]

        # requests reach it through the surviving nodes
        async def answer(message: AnyMessage) -> Message | None:
            return Ack(detail="from another node")

        await worker.subscribe(worker_subject(CLUSTER, "rollout", "w0"), answer)
        await asyncio.sleep(0.3)  # interest travels over the route
        reply = await control.request(worker_subject(CLUSTER, "rollout", "w0"), GenerateRequest(job_id="j",
                                      prompt_token_ids=[]), timeout=5.0)  # fmt: skip
        assert isinstance(reply, Ack) and reply.detail == "from another node"
        await beat.stop()
        await registry.stop()
        await worker.close()
        await control.close()
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.timeout(30)
async def test_a_request_nobody_takes_just_after_a_reconnect_waits_for_its_worker_to_come_back(
    server: EmbeddedNats,
) -> None:
    asker = await _connect(server.url, "asker", tier="controller")
    worker = await _connect(server.url, "worker")
    try:
        await _outage(server, 0.5)
        await _until(lambda: asker.is_connected, 10, "the asker's reconnect")

        async def answer(message: AnyMessage) -> Message | None:
            return Ack(detail="back")

        async def rejoin_late() -> None:  # a worker whose own reconnect comes 1.5 s after the asker's
            await asyncio.sleep(1.5)
            await worker.subscribe(worker_subject(CLUSTER, "trainer", "t0"), answer)

        late = asyncio.create_task(rejoin_late())
        reply = await asker.request(
            worker_subject(CLUSTER, "trainer", "t0"), Ack(), timeout=10.0, tier="trainer"
        )
        await late
        assert isinstance(reply, Ack) and reply.detail == "back"
    finally:
        await asker.close()
        await worker.close()
