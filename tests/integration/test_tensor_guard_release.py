"""Who releases a rollout batch: only its store's owner, the rollout worker, once it has been trained on.

A ref's capability reads but never deletes (a reward worker or the trainer cannot drop a batch
the others still need), so the controller no longer deletes in the rollout workers' stores: a
real :class:`RolloutWorker` (tiny model, HF engine, real TensorStore, in-process control plane)
frees its batches itself when it loads a newer weight version, which a step publishes only after
it trained on them. Memory stays bounded by one step's batches, not by the store's TTL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.control.inproc_transport import InProcessBroker, InProcessTransport
from rlfleet.common.control.messages import GenerateRequest, LoadWeights, SamplingParams
from rlfleet.common.errors import TensorAccessDenied
from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.common.tensors.store import TensorStoreClient
from rlfleet.rollout.service import RolloutWorker


@pytest.mark.timeout(120)
async def test_a_rollout_worker_frees_its_batches_when_it_loads_newer_weights(tiny_model_dir: Path) -> None:
    config = RolloutWorkerConfig(fleet={"cluster": "release"}, worker_id="rollout-0",
                                 model_path=str(tiny_model_dir), rollout={"engine": "hf"},
                                 placement={"device": "cpu"}, catch_up_timeout_s=0.5)  # fmt: skip
    transport = InProcessTransport(InProcessBroker(), tier="rollout", name="rollout-0")
    worker = RolloutWorker(config, transport)
    await worker.setup()  # no trainer here: it starts at its own weight version
    sampling = SamplingParams(n=2, max_tokens=4, seed=1)
    try:
        start = worker.weight_version
        made = [
            await worker.generate(
                GenerateRequest(
                    job_id=f"job-{i}", prompt_token_ids=[[5, 6, 7]], sampling=sampling, weight_version=start
                )
            )  # fmt: skip
            for i in range(2)
        ]
        refs = [result.ref for result in made]
        async with TensorStoreClient(
            worker.store.address
        ) as holder:  # what the trainer or a reward worker holds
            for ref in refs:
                with pytest.raises(TensorAccessDenied, match="secret"):
                    await holder.delete(ref)
                assert "response_ids" in await holder.fetch(ref)
        assert sorted(worker.store.keys) == sorted(ref.key for ref in refs)
        await worker.load_weights(LoadWeights(weight_version=start + 1, buckets=[]))  # the step's publish
        assert worker.store.keys == []
        newer = await worker.generate(
            GenerateRequest(
                job_id="job-2", prompt_token_ids=[[5]], sampling=sampling, weight_version=start + 1
            )
        )
        await worker.load_weights(LoadWeights(weight_version=start + 1, buckets=[]))  # the same version again
        assert worker.store.keys == [newer.ref.key]  # a batch of the version in force stays
    finally:
        await worker.teardown()
        await transport.close()
