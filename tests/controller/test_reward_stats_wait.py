"""The reward statistics a checkpoint keeps wait for a reward worker being restarted (issue 29,
point 2): a checkpoint taken right after the only reward worker crashed must not end the run."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.common.control.inproc_transport import InProcessBroker, InProcessTransport
from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.messages import AnyMessage, RewardStats, RewardStatsRequest, WorkerAnnounce
from rlfleet.common.control.transport import membership_subject, worker_subject
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.reward_control import RewardControl

CLUSTER = "stats-wait"


async def _reward_worker_back_after(broker: InProcessBroker, delay_s: float) -> InProcessTransport:
    await asyncio.sleep(delay_s)
    transport = InProcessTransport(broker, name="reward-0")
    own = worker_subject(CLUSTER, "reward", "reward-0")

    async def answer(message: AnyMessage) -> AnyMessage:
        assert isinstance(message, RewardStatsRequest)
        return RewardStats(worker_id="reward-0", endpoints={})

    await transport.subscribe(own, answer)
    announce = WorkerAnnounce(tier="reward", worker_id="reward-0", subject=own)
    await transport.publish(membership_subject(CLUSTER, "reward"), announce)
    return transport


@pytest.mark.timeout(30)
async def test_stats_wait_for_a_reward_worker_to_be_back() -> None:
    broker = InProcessBroker()
    transport = InProcessTransport(broker, name="controller")
    registry = WorkerRegistry(transport, CLUSTER)
    await registry.start()
    faults = FaultSettings(empty_pool_wait_s=10.0)
    control = RewardControl(transport, CLUSTER, registry, token="", faults=faults)
    back = asyncio.create_task(_reward_worker_back_after(broker, 0.5))
    try:
        stats = await control.stats()
    finally:
        await back
        await registry.stop()
    assert stats.worker_id == "reward-0"


@pytest.mark.timeout(30)
async def test_stats_name_the_missing_tier_once_the_wait_is_spent() -> None:
    broker = InProcessBroker()
    transport = InProcessTransport(broker, name="controller")
    registry = WorkerRegistry(transport, CLUSTER)
    await registry.start()
    faults = FaultSettings(empty_pool_wait_s=0.3, retry_attempts=1)
    control = RewardControl(transport, CLUSTER, registry, token="", faults=faults)
    try:
        with pytest.raises(Exception, match="no reward worker is known on cluster 'stats-wait'"):
            await control.stats()
    finally:
        await registry.stop()
