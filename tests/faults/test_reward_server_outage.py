"""A shared reward server's NATS outage (issue 12, point 4): the run's second connection, to
``reward.url``, meets it as the run's own connection does. Its nats-server stopped and started
again on its port after three times ``faults.dead_after_s`` reaps no reward worker, and a score
sent during the outage is answered once the connection is back; a server that does not come back
fails the score after ``faults.outage_grace_s`` with a named error instead of waiting out the
request's deadline. Real nats-servers (the run's and the reward server's), a real reward worker
on the shared one, a real TensorStore holding the rollout batch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.messages import GenerateResult
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.errors import NatsServerError
from rlfleet.common.schema.batch import RolloutBatch
from rlfleet.common.schema.config import load_config
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors.store import TensorStoreServer
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.reward_control import RewardControl
from rlfleet.reward.service import RewardWorker, RewardWorkerConfig

SHARED = "shared"
TOKEN = "token-of-team-o"
ENDPOINT = "o/short"
FAST = dict(reconnect_time_wait=0.1, reconnect_max_wait=0.3, connect_timeout=2.0)


@pytest.fixture
def servers() -> Iterator[tuple[EmbeddedNats, EmbeddedNats]]:
    """The run's own nats-server and the shared reward server's (which the tests stop and restart)."""
    with EmbeddedNats(jetstream=False) as own, EmbeddedNats(jetstream=False) as shared:
        yield own, shared


@pytest.fixture
async def batch() -> AsyncIterator[TensorRef]:
    """A rollout batch of two samples in a real TensorStore (what a rollout worker would hold)."""
    store = TensorStoreServer()
    await store.start()
    rows = RolloutBatch.from_rows(prompts=[[1, 2]] * 2, responses=[[3]] * 2, logprobs=[[0.0]] * 2,
                                  group_index=[0, 0], pad_id=0, prompt_text=["p", "p"],
                                  response_text=["one", "one two three"])  # fmt: skip
    yield store.put_local("batch", rows.to_tensors())
    await store.stop()


@pytest.fixture
async def reward_worker(servers: tuple[EmbeddedNats, EmbeddedNats]) -> AsyncIterator[RewardWorker]:
    data: dict[str, Any] = {
        "fleet": {"cluster": SHARED}, "worker_id": "reward-0", "quota_store": "process", "heartbeat_s": 0.25,
        "endpoints": {ENDPOINT: "concise:max_words=2"},
        "tenants": [{"name": "team-o", "token": TOKEN, "endpoints": [ENDPOINT]}],
    }  # fmt: skip
    transport = await NatsTransport.connect(servers[1].url, name="reward-0", tier="reward", **FAST)  # type: ignore[arg-type]
    worker = RewardWorker(load_config(RewardWorkerConfig, data=data), transport)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop("test over")
        await transport.close()


async def _control(own: EmbeddedNats, shared: EmbeddedNats, faults: FaultSettings) -> RewardControl:
    """What ``attach_reward`` makes of a job with ``reward.url`` on another server than the run's."""
    run = await NatsTransport.connect(own.url, name="controller", tier="controller", **FAST)  # type: ignore[arg-type]
    registry = WorkerRegistry(run, "run")
    config = TrainerConfig(reward={"url": shared.url, "cluster": SHARED, "token": TOKEN}, faults=faults)
    control = await RewardControl.connect(config, run, "run", registry, own.url)
    control._owned.append(run)  # closed with it
    await control.wait_ready(10)
    return control


def _result(ref: TensorRef) -> GenerateResult:
    return GenerateResult(job_id="gen", worker_id="rollout-0", weight_version=0, ref=ref, num_prompts=1,
                          num_samples=2, num_tokens=2)  # fmt: skip


@pytest.mark.timeout(60)
async def test_an_outage_of_the_shared_reward_server_reaps_nobody_and_the_score_resumes(
    servers: tuple[EmbeddedNats, EmbeddedNats], reward_worker: RewardWorker, batch: TensorRef
) -> None:
    own, shared = servers
    faults = FaultSettings(dead_after_s=1.0, outage_grace_s=30.0)
    control = await _control(own, shared, faults)
    reaped: list[str] = []
    control.registry.on_dead = lambda info: reaped.append(info.worker_id)
    try:
        assert control.registry.dead_after == 1.0 and control.transport.outage_grace_s == 30.0
        await asyncio.to_thread(shared.stop, keep_port=True)
        scoring = asyncio.ensure_future(control.score([_result(batch)], [[{}, {}]], ENDPOINT, ["s-1"]))
        await asyncio.sleep(3.0)  # three times dead_after
        assert not scoring.done()
        await asyncio.to_thread(shared.start)
        (scored,) = await asyncio.wait_for(scoring, 30)
        assert scored.job_id == "s-1" and len(scored.scores) == 2 and scored.scores[0] == 1.0
        await asyncio.sleep(1.5)  # heartbeats flow again: past dead_after with the connection up
        assert reaped == [] and [w.worker_id for w in control.registry.workers("reward")] == ["reward-0"]
    finally:
        await control.close()


@pytest.mark.timeout(60)
async def test_a_shared_reward_server_gone_past_outage_grace_fails_the_score_naming_it(
    servers: tuple[EmbeddedNats, EmbeddedNats], reward_worker: RewardWorker, batch: TensorRef
) -> None:
    own, shared = servers
    control = await _control(own, shared, FaultSettings(outage_grace_s=2.0))
    try:
        await asyncio.to_thread(shared.stop, keep_port=True)
        began = time.monotonic()
        with pytest.raises(NatsServerError, match="outage_grace_s 2") as caught:
            await control.score([_result(batch)], [[{}, {}]], ENDPOINT, ["s-2"])
        took = time.monotonic() - began
        assert "rlfleet-controller-reward" in str(caught.value) and "reward" in str(caught.value)
        assert took < 15, f"the score waited {took:.0f}s, not outage_grace_s (2 s)"
    finally:
        await control.close()
