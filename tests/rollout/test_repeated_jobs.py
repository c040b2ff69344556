"""A rollout worker answers a repeated job id once (issue 12, point 4): a generate that the NATS
transport sends again after an outage, or a weight load retried with its job id, gets the first
job's reply instead of running twice. A real nats-server restarted on its port, a real rollout
worker (HF engine, tiny model, CPU) in this process, the controller's own NATS transport."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from real_worker import running_worker  # (this folder's helper)

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import (
    GenerateRequest,
    GenerateResult,
    LoadWeights,
    SamplingParams,
    WeightsLoaded,
)
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.errors import RemoteUserError
from rlfleet.rollout.service import RolloutWorker

CLUSTER = "repeats"
FAST = dict(reconnect_time_wait=0.1, reconnect_max_wait=0.3, connect_timeout=2.0)


@pytest.fixture
def server() -> Iterator[EmbeddedNats]:
    """A nats-server of this test alone (the test restarts it on its port)."""
    with EmbeddedNats(jetstream=False) as nats:
        yield nats


@pytest.fixture
async def worker(server: EmbeddedNats, make_checkpoint) -> AsyncIterator[RolloutWorker]:  # noqa: ANN001
    async with running_worker(server.url, make_checkpoint(), cluster=CLUSTER, **FAST) as started:
        yield started


async def _until(check: Callable[[], object], timeout: float, what: str) -> None:
    for _ in range(int(timeout / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _batches(worker: RolloutWorker) -> list[str]:
    return [key for key in worker.store.keys if key.startswith("rollout/")]


@pytest.mark.timeout(60)
async def test_a_generate_sent_again_after_an_outage_runs_once(
    server: EmbeddedNats, worker: RolloutWorker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rlfleet.common.control.reply_cache")
    control = await NatsTransport.connect(server.url, name="controller", tier="controller", **FAST)  # type: ignore[arg-type]
    job = GenerateRequest(job_id="run-gen-0", prompt_token_ids=[[5, 6, 7], [8, 9]],
                          sampling=SamplingParams(n=2, max_tokens=6, seed=3))  # fmt: skip
    try:
        async with worker._gpu:  # the engine is busy: the job waits in the worker while the server restarts
            reply = asyncio.ensure_future(
                control.request(worker.own_subject, job, timeout=40, tier="rollout")
            )
            await _until(lambda: len(worker.in_flight) == 1, 10, "the worker to take the job")
            await asyncio.to_thread(server.stop, keep_port=True)
            await asyncio.sleep(1.5)
            await asyncio.to_thread(server.start)
            await _until(lambda: control.is_connected and worker.transport.is_connected, 15, "reconnects")
            await _until(lambda: len(worker.in_flight) == 2, 15, "the resent request to reach the worker")
        result = await reply
        assert control.drops == 1
    finally:
        await control.close()
    assert isinstance(result, GenerateResult) and result.num_samples == 4
    assert _batches(worker) == [result.ref.key], "the resent generate ran a second time"
    assert "run-gen-0 repeated: answering with its first reply" in caplog.text
    # the worker's metrics count the tokens it generated once, the repeat not again
    line = f'rlfleet_tokens_total{{tier="rollout",worker="{worker.worker_id}"}} {float(result.num_tokens)}'
    assert result.num_tokens > 0 and line in worker.metrics.exposition().decode()


@pytest.mark.timeout(60)
async def test_a_weight_load_with_a_seen_job_id_loads_once(
    server: EmbeddedNats, worker: RolloutWorker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rlfleet.rollout.service")
    control = await NatsTransport.connect(server.url, name="controller", tier="controller", **FAST)  # type: ignore[arg-type]
    load = LoadWeights(weight_version=worker.weight_version + 1, buckets=[], job_id="run-load-1")
    try:
        first = await control.request(worker.own_subject, load, timeout=20, tier="rollout")
        again = await control.request(worker.own_subject, load, timeout=20, tier="rollout")
        other = load.model_copy(update={"weight_version": load.weight_version + 1})
        with pytest.raises(RemoteUserError, match="run-load-1.*weight_version"):
            await control.request(worker.own_subject, other, timeout=20, tier="rollout")
        fresh = await control.request(worker.own_subject, other.model_copy(update={"job_id": "run-load-2"}),
                                      timeout=20, tier="rollout")  # fmt: skip
    finally:
        await control.close()
    assert isinstance(first, WeightsLoaded) and first == again
    assert isinstance(fresh, WeightsLoaded) and fresh.weight_version == load.weight_version + 1
    loads = [r for r in caplog.records if r.getMessage().startswith("loaded weight version")]
    assert len(loads) == 2, [r.getMessage() for r in loads]  # run-load-1 once, run-load-2 once
