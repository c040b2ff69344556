"""Fleet.generate over fake rollout workers on the in-process transport: capacity shares,
admission by weight version (a stale worker is sent the published weights first), immediate
re-dispatch when a worker leaves mid-job, and a job whose pool went empty waiting for a worker
(within faults.empty_pool_wait_s, then a stop naming the pool)."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.common.control.inproc_transport import InProcessBroker, InProcessTransport
from rlfleet.common.control.messages import (
    AnyMessage,
    GenerateRequest,
    GenerateResult,
    LoadWeights,
    SamplingParams,
    WeightsLoaded,
    WeightsPublished,
    WorkerAnnounce,
    WorkerLeave,
)
from rlfleet.common.control.transport import membership_subject, worker_subject
from rlfleet.common.schema.refs import TensorRef
from rlfleet.controller.errors import NoWorkerServed
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.fleet import Fleet, split_by_capacity

CLUSTER = "unit"


class FakeWorker:
    """Answers generate and load-weights requests on its own subject; ``hang`` never replies."""

    def __init__(
        self, broker: InProcessBroker, worker_id: str, *, capacity: int = 1, version: int = 0
    ) -> None:
        self.transport = InProcessTransport(broker, tier="rollout", name=worker_id)
        self.worker_id, self.capacity, self.version = worker_id, capacity, version
        self.jobs: list[int] = []  # prompts per generate request received
        self.hang = False

    async def start(self) -> None:
        self.own = await self.transport.subscribe(
            worker_subject(CLUSTER, "rollout", self.worker_id), self._on_message
        )
        await self.announce()

    async def announce(self) -> None:
        await self.transport.publish(membership_subject(CLUSTER, "rollout"), WorkerAnnounce(
            tier="rollout", worker_id=self.worker_id, capacity=self.capacity, weight_version=self.version,
            subject=worker_subject(CLUSTER, "rollout", self.worker_id),
        ))  # fmt: skip

    async def leave(self) -> None:
        await (
            self.own.unsubscribe()
        )  # as a real worker does: the registry believes a leave once nobody answers
        await self.transport.publish(
            membership_subject(CLUSTER, "rollout"), WorkerLeave(tier="rollout", worker_id=self.worker_id)
        )

    async def _on_message(self, message: AnyMessage) -> AnyMessage:
        if isinstance(message, LoadWeights):
            self.version = message.weight_version
            return WeightsLoaded(worker_id=self.worker_id, weight_version=self.version)
        assert isinstance(message, GenerateRequest)
        assert message.weight_version == self.version, "a stale worker must never be asked to serve"
        self.jobs.append(len(message.prompt_token_ids))
        if self.hang:
            await asyncio.sleep(3600)
        ref = TensorRef(address="fake:0", key=message.job_id, nbytes=1)
        count = len(message.prompt_token_ids)
        return GenerateResult(job_id=message.job_id, worker_id=self.worker_id, weight_version=self.version,
                              ref=ref, num_prompts=count, num_samples=count)  # fmt: skip


async def _fleet(broker: InProcessBroker, workers: list[FakeWorker]) -> Fleet:
    fleet = Fleet(InProcessTransport(broker, name="controller"), CLUSTER, request_timeout=60.0)
    await fleet.start()
    for worker in workers:
        await worker.start()
    await fleet.wait_ready({"rollout": len(workers)}, timeout=5)
    return fleet


def test_split_by_capacity_is_proportional_and_exact() -> None:
    assert split_by_capacity(8, [3, 1]) == [6, 2]
    assert split_by_capacity(7, [1, 1, 1]) == [3, 2, 2]
    assert split_by_capacity(2, [1, 1, 1]) == [1, 1, 0]
    assert sum(split_by_capacity(101, [5, 3, 2, 7])) == 101
    with pytest.raises(ValueError, match="at least one"):
        split_by_capacity(3, [])


@pytest.mark.timeout(20)
async def test_prompts_are_shared_by_capacity() -> None:
    broker = InProcessBroker()
    big, small = FakeWorker(broker, "r-big", capacity=3), FakeWorker(broker, "r-small", capacity=1)
    fleet = await _fleet(broker, [big, small])
    results = await fleet.generate([[1]] * 8, SamplingParams(), weight_version=0)
    assert [r.num_prompts for r in results] == [6, 2] and big.jobs == [6] and small.jobs == [2]
    await fleet.close()


@pytest.mark.timeout(20)
async def test_stale_worker_is_sent_published_weights_before_it_serves() -> None:
    broker = InProcessBroker()
    current, stale = FakeWorker(broker, "r-a", version=1), FakeWorker(broker, "r-b", version=0)
    fleet = await _fleet(broker, [current, stale])
    fleet.published = WeightsPublished(weight_version=1, buckets=[], nbytes=0, seconds=0.0)
    first = await fleet.generate([[1]] * 4, SamplingParams(), weight_version=1)
    assert {r.worker_id for r in first} == {"r-a"} and stale.jobs == []
    for _ in range(100):  # the background admission lands
        if stale.version == 1 and fleet.registry.get("rollout", "r-b").weight_version == 1:
            break
        await asyncio.sleep(0.01)
    second = await fleet.generate([[1]] * 4, SamplingParams(), weight_version=1)
    assert {r.worker_id for r in second} == {"r-a", "r-b"}
    await fleet.close()


@pytest.mark.timeout(20)
async def test_chunk_of_a_leaving_worker_is_redispatched_at_once() -> None:
    broker = InProcessBroker()
    good, leaving = FakeWorker(broker, "r-a"), FakeWorker(broker, "r-b")
    leaving.hang = True
    fleet = await _fleet(broker, [good, leaving])
    step = asyncio.ensure_future(fleet.generate([[1]] * 6, SamplingParams(), weight_version=0))
    while not leaving.jobs:
        await asyncio.sleep(0.01)
    await leaving.leave()
    results = await asyncio.wait_for(step, timeout=5)  # far below request_timeout (60 s)
    assert [r.worker_id for r in results] == ["r-a", "r-a"]
    assert [r.num_prompts for r in results] == [3, 3] and good.jobs == [3, 3]
    await fleet.close()


@pytest.mark.timeout(20)
async def test_a_chunk_waits_for_its_empty_pool_to_have_a_worker_again() -> None:
    broker = InProcessBroker()
    only = FakeWorker(broker, "r-a")
    only.hang = True
    fleet = await _fleet(broker, [only])
    step = asyncio.ensure_future(fleet.generate([[1]] * 4, SamplingParams(), weight_version=0))
    while not only.jobs:
        await asyncio.sleep(0.01)
    await only.leave()  # the pool is empty now, its job in flight
    await asyncio.sleep(0.5)
    assert not step.done(), "the job waits for the pool instead of giving up"
    back = FakeWorker(broker, "r-b")
    await back.start()
    results = await asyncio.wait_for(step, timeout=5)
    assert [r.worker_id for r in results] == ["r-b"] and back.jobs == [4]
    await fleet.close()


@pytest.mark.timeout(20)
async def test_a_pool_empty_past_its_budget_is_a_named_stop() -> None:
    broker = InProcessBroker()
    only = FakeWorker(broker, "r-a")
    fleet = await _fleet(broker, [only])
    fleet.faults = FaultSettings(empty_pool_wait_s=0.5)
    await only.leave()
    while fleet.rollout_workers():
        await asyncio.sleep(0.01)
    with pytest.raises(NoWorkerServed) as caught:
        await fleet.generate([[1]] * 4, SamplingParams(), weight_version=0, pool="small")
    assert (
        "generating 4 prompts at weight version 0: rollout pool 'small' of cluster unit had no live worker"
        in (str(caught.value))
    )
    assert "(faults.empty_pool_wait_s=0.5)" in str(caught.value)
    await fleet.close()
