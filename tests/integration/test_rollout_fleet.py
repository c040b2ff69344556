"""The rollout fleet: standalone ``rlfleet-rollout serve`` workers join, leave and die mid-job.

Each test starts a real nats-server and real rollout worker processes (the console script, tiny
model, CPU) and drives them with the controller's :class:`Fleet`:

- kill: a worker killed (SIGKILL) in the middle of a step has its chunk re-dispatched; the step
  completes and every prompt's samples come back exactly once (``group_index`` coverage);
- join: a worker started after a weight publish loads that version before it announces, and the
  controller admits it (stale workers are sent the published buckets first);
- leave: SIGTERM makes a worker say goodbye; no job is sent to it afterwards;
- wire skew under delta sync: a worker that announces a wire before packed deltas (2.10) is sent
  the whole version while the others take the delta.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import torch

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import WorkerInfo
from rlfleet.common.control.messages import (
    AnyMessage,
    GenerateRequest,
    LatestWeights,
    SamplingParams,
    WeightsPublished,
)
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject
from rlfleet.common.tensors.store import TensorStoreClient, TensorStoreServer
from rlfleet.common.tensors.weight_sync import NAMES, fingerprint, weight_delta
from rlfleet.controller.fleet import Fleet

CLUSTER = "fleet-test"


class Workers:
    """Rollout worker processes started by one test (stopped by pid at the end)."""

    def __init__(self, script: str, model: Path, url: str, env: dict[str, str], logs: Path) -> None:
        self.script, self.model, self.url, self.env, self.logs = script, model, url, env, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, worker_id: str) -> None:
        log = (self.logs / f"{worker_id}.log").open("wb")
        self.procs[worker_id] = subprocess.Popen(
            [self.script, "serve", "--model", str(self.model), "--nats", self.url, "--cluster", CLUSTER,
             "--pool", "default", "--worker-id", worker_id, "placement.device=cpu",
             "rollout.max_batch_size=1", "heartbeat_s=0.3", "catch_up_timeout_s=5"],
            stdout=log, stderr=subprocess.STDOUT, env=self.env,
        )  # fmt: skip

    def signal(self, worker_id: str, sig: int) -> None:
        os.kill(self.procs[worker_id].pid, sig)

    def log(self, worker_id: str) -> str:
        return (self.logs / f"{worker_id}.log").read_text()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture
def nats() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(jetstream=False) as server:
        yield server


@pytest.fixture
def workers(
    nats: EmbeddedNats, venv_script: Callable[[str], str], tiny_model_dir: Path, cli_env: dict[str, str],
    tmp_path: Path,
) -> Iterator[Workers]:  # fmt: skip
    started = Workers(venv_script("rlfleet-rollout"), tiny_model_dir, nats.url, cli_env, tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture
async def fleet(nats: EmbeddedNats) -> AsyncIterator[Fleet]:
    transport = await NatsTransport.connect(nats.url, name="test-controller")
    controller = Fleet(transport, CLUSTER, request_timeout=120.0, dead_after=2.0)
    await controller.start()
    try:
        yield controller
    finally:
        await controller.close()
        await transport.close()


def _prompts(count: int) -> list[list[int]]:
    """Distinct 3-token prompts (ids 4..13 are letters of the tiny tokenizer's vocabulary)."""
    return [[4 + (i % 10), 4 + (i // 10) % 10, 4 + (i * 7) % 10] for i in range(count)]


async def _answered(results: list, prompts: list[list[int]], n: int) -> Counter[int]:
    """How often each prompt index was answered; checks each sample's prompt matches its index."""
    seen: Counter[int] = Counter()
    start = 0
    for result in results:
        client = TensorStoreClient(result.ref.address)
        try:
            batch = await client.fetch(result.ref)
        finally:
            await client.close()
        for row, group in enumerate(batch["group_index"].tolist()):
            index = start + group
            ids = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
            assert ids == prompts[index], f"sample {row} of {result.job_id} answers the wrong prompt"
            seen[index] += 1
        start += result.num_prompts
    return seen


async def _wait_busy(fleet: Fleet, worker_id: str, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        info = fleet.registry.get("rollout", worker_id)
        if info is not None and info.busy > 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{worker_id} never reported a job in progress")


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_killed_worker_chunk_is_redispatched_and_every_prompt_answered_once(
    workers: Workers, fleet: Fleet
) -> None:
    workers.start("rollout-a")
    workers.start("rollout-b")
    await fleet.wait_ready({"rollout": 2}, timeout=120)
    prompts, n = _prompts(12), 2
    sampling = SamplingParams(n=n, temperature=1.0, max_tokens=40, seed=0)
    step = asyncio.ensure_future(fleet.generate(prompts, sampling, weight_version=0))
    await _wait_busy(fleet, "rollout-b", timeout=60)
    assert not step.done(), "the step ended before the kill: make the job longer"
    workers.signal("rollout-b", signal.SIGKILL)
    t0 = asyncio.get_running_loop().time()
    results = await asyncio.wait_for(step, timeout=150)
    print(f"step finished {asyncio.get_running_loop().time() - t0:.1f}s after the kill")
    assert {r.worker_id for r in results} == {"rollout-a"}, "rollout-b's chunk must be re-dispatched"
    assert fleet.registry.get("rollout", "rollout-b") is None
    seen = await _answered(results, prompts, n)
    assert seen == Counter({i: n for i in range(len(prompts))})


def _perturbed_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    return {
        name: tensor + 0.5 * torch.randn(tensor.shape, generator=gen)
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight" and tensor.is_floating_point()
    }


async def _greedy(fleet: Fleet, worker_id: str, prompts: list[list[int]], version: int) -> list[list[int]]:
    info = fleet.registry.get("rollout", worker_id)
    assert info is not None
    job = f"greedy-{worker_id}-v{version}"  # a job id names one request (a repeat is answered from cache)
    request = GenerateRequest(job_id=job, prompt_token_ids=prompts, weight_version=version,
                              sampling=SamplingParams(n=1, temperature=0.0, max_tokens=8))  # fmt: skip
    reply = await fleet.transport.request(info.subject, request, timeout=60, tier="rollout")
    client = TensorStoreClient(reply.ref.address)  # type: ignore[union-attr]
    try:
        batch = await client.fetch(reply.ref)  # type: ignore[union-attr]
    finally:
        await client.close()
    return [
        row[mask.bool()].tolist()
        for row, mask in zip(batch["response_ids"], batch["response_mask"], strict=True)
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_late_worker_loads_current_version_before_joining_and_leaver_gets_no_jobs(
    workers: Workers, fleet: Fleet, tiny_model_dir: Path
) -> None:
    workers.start("rollout-a")
    workers.start("rollout-b")
    await fleet.wait_ready({"rollout": 2}, timeout=120)
    # stand in for the trainer: version 1 staged in a real TensorStore, answered on trainer.latest
    store = TensorStoreServer(capacity_bytes=1 << 30, ttl_s=600)
    await store.start()
    ref = store.put_local("weights/v1/0", _perturbed_weights(tiny_model_dir))
    published = WeightsPublished(weight_version=1, buckets=[ref], nbytes=ref.nbytes, seconds=0.0)

    async def latest(message: AnyMessage) -> AnyMessage:
        assert isinstance(message, LatestWeights)
        return published

    await fleet.transport.subscribe(subject(CLUSTER, "trainer", "latest"), latest)
    joined_at: dict[str, int] = {}
    on_join = fleet.registry.on_join

    def record_join(info: WorkerInfo) -> None:
        joined_at.setdefault(info.worker_id, info.weight_version)
        if on_join is not None:
            on_join(info)

    fleet.registry.on_join = record_join
    try:
        prompts = _prompts(6)
        before = await _greedy(fleet, "rollout-a", prompts, 0)
        loaded = await fleet.load_weights(published)
        assert sorted(r.worker_id for r in loaded) == ["rollout-a", "rollout-b"]
        workers.start("rollout-c")
        await fleet.wait_ready({"rollout": 3}, timeout=120)
        assert joined_at["rollout-c"] == 1, "a late worker must announce only once it holds version 1"
        assert "caught up to weight version 1" in workers.log("rollout-c")
        after = [await _greedy(fleet, w, prompts, 1) for w in ("rollout-a", "rollout-b", "rollout-c")]
        assert after[0] == after[1] == after[2] != before
        results = await fleet.generate(_prompts(9), SamplingParams(n=2, max_tokens=4), weight_version=1)
        assert {r.worker_id for r in results} == {"rollout-a", "rollout-b", "rollout-c"}

        workers.signal("rollout-a", signal.SIGTERM)
        await asyncio.wait_for(_gone(fleet, "rollout-a"), timeout=1.5)  # WorkerLeave, not dead_after
        results = await fleet.generate(_prompts(9), SamplingParams(n=2, max_tokens=4), weight_version=1)
        assert {r.worker_id for r in results} == {"rollout-b", "rollout-c"}
        assert Counter((await _answered(results, _prompts(9), 2)).values()) == Counter({2: 9})
    finally:
        await store.stop()


async def _gone(fleet: Fleet, worker_id: str) -> None:
    while fleet.registry.get("rollout", worker_id) is not None:
        await asyncio.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_worker_before_packed_deltas_loads_the_version_whole(
    workers: Workers, fleet: Fleet, tiny_model_dir: Path
) -> None:
    """Since wire 2.10 a delta bucket's changed elements travel packed, which a worker of an older
    release cannot read: the controller sends a delta only to workers whose announce says 2.10 or
    later, the others load the same version whole, and every load is verified against the published
    fingerprint (the older worker is the controller's record of its announce set back to 2.9)."""
    workers.start("rollout-new")
    workers.start("rollout-old")
    await fleet.wait_ready({"rollout": 2}, timeout=120)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    v1 = {n: t.clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    v2 = {n: t.clone() for n, t in v1.items()}
    g = torch.Generator().manual_seed(1)
    for tensor in v2.values():  # 1% of each weight moved: a sparse delta
        picked = torch.randperm(tensor.numel(), generator=g)[: max(1, tensor.numel() // 100)]
        tensor.view(-1)[picked] += 0.5
    store = TensorStoreServer(capacity_bytes=1 << 28, ttl_s=600)
    await store.start()
    try:
        delta = weight_delta(v1, v2)
        assert NAMES in delta  # packed
        first = WeightsPublished(weight_version=1, buckets=[store.put_local("w/v1", v1)], nbytes=1,
                                 seconds=0.0, fingerprint=fingerprint(v1.items()))  # fmt: skip
        loaded = await fleet.load_weights(first, hold=True)
        assert sorted(r.worker_id for r in loaded) == ["rollout-new", "rollout-old"]
        old = fleet.registry.get("rollout", "rollout-old")
        assert old is not None
        old.announce.protocol = "2.9"  # as a worker of that release announces itself
        staged = store.put_local("w/v2-delta", delta)
        second = WeightsPublished(weight_version=2, buckets=[store.put_local("w/v2", v2)], nbytes=1,
                                  seconds=0.0, fingerprint=fingerprint(v2.items()), delta_buckets=[staged],
                                  delta_from=1)  # fmt: skip
        loaded = await fleet.load_weights(second, hold=True)  # each verified against the fingerprint
    finally:
        await store.stop()
    by_id = {r.worker_id: r for r in loaded}
    assert by_id["rollout-new"].delta and not by_id["rollout-old"].delta
    assert {r.fingerprint for r in loaded} == {second.fingerprint}
