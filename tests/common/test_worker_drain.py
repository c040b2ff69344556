"""Workers drain when they stop, and their heartbeats say what they are doing (issue 12, point 3).

Real nats-server, real :class:`Worker` s (a stand-in tier whose handler waits for the test to let
it finish). A request a worker took before it was told to stop gets its real answer; a request
sent while it drains goes to another replica of the queue group; one that reached the stopping
worker but had not started is refused as retryable (``unavailable``), never dropped; a handler
that outlives ``drain_s`` is cancelled so the worker still leaves in time. Heartbeats carry the
oldest request in progress (kind, job id, seconds) and, while stopping, that the worker drains.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.messages import Ack, AnyMessage, ScoreRequest
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject
from rlfleet.common.control.worker import Worker
from rlfleet.common.errors import RemoteError, RequestTimeout
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.worker import FleetAddress, ServiceConfig

CLUSTER = "drain"
WORK = subject(CLUSTER, "reward", "score")
REF = TensorRef(address="127.0.0.1:1", key="never-read")


class SlowWorker(Worker[ServiceConfig]):
    """Answers ``reward.score`` with its worker id, after ``release`` is set (or at once when it is)."""

    tier = "reward"

    def __init__(self, config: ServiceConfig, transport: NatsTransport, max_concurrency: int = 4) -> None:
        super().__init__(config, transport)
        self.release = asyncio.Event()
        self.started: list[str] = []
        self.max_concurrency = max_concurrency

    async def setup(self) -> None:
        await self.subscribe(WORK, self._work, queue="reward", max_concurrency=self.max_concurrency)

    async def _work(self, message: AnyMessage) -> AnyMessage:
        assert isinstance(message, ScoreRequest)
        self.started.append(message.job_id)
        await self.release.wait()
        return Ack(detail=f"{self.worker_id}:{message.job_id}")


def request(job_id: str) -> ScoreRequest:
    return ScoreRequest(job_id=job_id, rollout=REF)


async def _until(check, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.02)


class Cluster:
    """Workers and a client on one nats-server; everything it made is closed by :meth:`close`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.transports: list[NatsTransport] = []
        self.workers: list[SlowWorker] = []
        self.client: NatsTransport | None = None

    async def worker(self, worker_id: str, drain_s: float = 10.0, max_concurrency: int = 4) -> SlowWorker:
        transport = await NatsTransport.connect(self.url, name=worker_id, tier="reward")
        self.transports.append(transport)
        config = ServiceConfig(fleet=FleetAddress(nats_url=self.url, cluster=CLUSTER), worker_id=worker_id,
                               heartbeat_s=0.1, drain_s=drain_s)  # fmt: skip
        worker = SlowWorker(config, transport, max_concurrency)
        await worker.start()
        self.workers.append(worker)
        return worker

    async def connect(self) -> NatsTransport:
        self.client = await NatsTransport.connect(self.url, name="client", tier="controller")
        self.transports.append(self.client)
        return self.client

    async def close(self) -> None:
        for worker in self.workers:
            worker.release.set()
            await worker.stop("test over")
        for transport in self.transports:
            await transport.close()


@pytest.fixture
async def cluster(nats_server: EmbeddedNats) -> AsyncIterator[Cluster]:
    made = Cluster(nats_server.url)
    try:
        yield made
    finally:
        await made.close()


@pytest.mark.timeout(60)
async def test_in_flight_request_finishes_and_new_ones_go_to_the_other_replica(cluster: Cluster) -> None:
    client = await cluster.connect()
    a = await cluster.worker("reward-a")
    first = asyncio.create_task(client.request(WORK, request("j1"), timeout=20))
    await _until(lambda: a.started == ["j1"], 10, "reward-a to take j1")
    b = await cluster.worker("reward-b")
    b.release.set()
    stopping = asyncio.create_task(a.stop("sigterm"))
    await _until(lambda: a.draining, 5, "reward-a to drain")
    assert "draining (1 in flight: reward.score job j1)" in a.status().activity
    during = await asyncio.gather(*(client.request(WORK, request(f"n{i}"), timeout=10) for i in range(6)))
    assert all(isinstance(r, Ack) and r.detail.startswith("reward-b:") for r in during), during
    assert not stopping.done(), "reward-a left before its request finished"
    a.release.set()
    reply = await first
    assert isinstance(reply, Ack) and reply.detail == "reward-a:j1"  # answered, not cancelled
    await asyncio.wait_for(stopping, 10)
    assert a.started == ["j1"]


@pytest.mark.timeout(60)
async def test_a_request_queued_on_a_draining_worker_is_refused_as_retryable(cluster: Cluster) -> None:
    client = await cluster.connect()
    a = await cluster.worker("reward-a", max_concurrency=1)
    first = asyncio.create_task(client.request(WORK, request("j1"), timeout=20))
    await _until(lambda: a.started == ["j1"], 10, "reward-a to take j1")
    queued = asyncio.create_task(client.request(WORK, request("j2"), timeout=20))  # waits for j1's slot
    await asyncio.sleep(0.3)
    stopping = asyncio.create_task(a.stop("sigterm"))
    await _until(lambda: a.draining, 5, "reward-a to drain")
    await asyncio.sleep(0.3)
    a.release.set()
    assert isinstance(await first, Ack)
    with pytest.raises(RemoteError) as refused:
        await queued
    assert refused.value.code == "unavailable" and refused.value.retryable, refused.value
    assert "reward-a is draining" in str(refused.value)
    await asyncio.wait_for(stopping, 10)
    assert a.started == ["j1"]  # j2 never started


@pytest.mark.timeout(60)
async def test_a_handler_past_drain_s_is_cancelled_and_the_worker_leaves(cluster: Cluster) -> None:
    client = await cluster.connect()
    a = await cluster.worker("reward-a", drain_s=1.0)
    stuck = asyncio.create_task(client.request(WORK, request("stuck"), timeout=6))
    await _until(lambda: a.started == ["stuck"], 10, "reward-a to take the request")
    start = time.monotonic()
    await asyncio.wait_for(a.stop("sigterm"), 10)
    assert time.monotonic() - start < 4.0
    with pytest.raises(RequestTimeout):
        await stuck


@pytest.mark.timeout(60)
async def test_heartbeats_carry_the_oldest_request_in_progress(cluster: Cluster) -> None:
    client = await cluster.connect()
    registry = WorkerRegistry(client, CLUSTER)
    await registry.start()
    try:
        a = await cluster.worker("reward-a")
        idle = await registry.wait_for("reward", 1, timeout=10)
        assert idle[0].activity == ""
        jobs = [asyncio.create_task(client.request(WORK, request(j), timeout=20)) for j in ("j1", "j2")]
        await _until(lambda: len(a.started) == 2, 10, "reward-a to take both")

        def seen() -> str:
            info = registry.get("reward", "reward-a")
            return info.activity if info is not None and info.activity_s >= 0.5 else ""

        await _until(lambda: seen() != "", 10, "a heartbeat with the activity")
        assert seen() == f"reward.score job {a.started[0]} (+1 more)"
        a.release.set()
        await asyncio.gather(*jobs)
        await _until(lambda: registry.get("reward", "reward-a").activity == "", 10, "an idle heartbeat")
    finally:
        await registry.stop()
