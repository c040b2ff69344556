"""Reward tier restarts with real processes (issue 12, point 3).

A real ``rlfleet-reward serve`` process, SIGTERMed while it scores a batch, answers that batch
before it exits (drain) and exits 0; started again on the same ``state_dir`` it serves the endpoint
a run created at run time, at the same revision. Two replicas, one killed with SIGKILL mid-score:
the request it held gets no reply, and its resend (what the controller's score retry does) and
every later request are answered by the survivor.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.messages import (
    RewardStats,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
)
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject, worker_subject
from rlfleet.common.errors import RequestTimeout
from rlfleet.common.schema.batch import RolloutBatch
from rlfleet.common.tensors.store import TensorStoreServer

CLUSTER = "reward-restart"
SLOW = """
import time

def slow(prompt, response, *, seconds=1.0, **metadata):
    time.sleep(seconds)
    return 1.0
"""


def serve(where: Path, config: Path, name: str) -> subprocess.Popen[bytes]:
    script = Path(sys.executable).parent / "rlfleet-reward"
    env = {**os.environ, "PYTHONPATH": str(where), "PYTHONUNBUFFERED": "1"}
    with open(where / f"{name}.log", "ab") as log:
        return subprocess.Popen([str(script), "serve", "--config", str(config)], stdout=log,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_sigterm_mid_score_answers_it_and_a_restart_keeps_created_endpoints(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    (tmp_path / "slow_reward.py").write_text(SLOW)
    config = tmp_path / "reward.yaml"
    config.write_text(yaml.safe_dump({
        "fleet": {"nats_url": nats_server.url, "cluster": CLUSTER}, "worker_id": "reward-0",
        "quota_store": "process",
        "state_dir": str(tmp_path / "state"), "drain_s": 30, "heartbeat_s": 0.5,
        "endpoints": {"slow": "slow_reward:slow:seconds=3"},
    }))  # fmt: skip
    store = TensorStoreServer()
    await store.start()
    batch = RolloutBatch.from_rows(prompts=[[1, 2]], responses=[[3]], logprobs=[[0.0]], group_index=[0],
                                   pad_id=0, prompt_text=["p"], response_text=["x"])  # fmt: skip
    ref = store.put_local("batch-0", batch.to_tensors())
    client = await NatsTransport.connect(nats_server.url, name="test", tier="controller")
    registry = WorkerRegistry(client, CLUSTER)
    await registry.start()
    own = worker_subject(CLUSTER, "reward", "reward-0")
    proc = serve(tmp_path, config, "reward-0")
    try:
        await registry.wait_for("reward", 1, timeout=120)
        made = await client.request(
            own, SetRewardSpec(endpoint="run/made", spec="charset:allowed=x"), timeout=60
        )
        scoring = asyncio.create_task(client.request(
            subject(CLUSTER, "reward", "score"), ScoreRequest(job_id="step1-0", endpoint="slow", rollout=ref),
            timeout=60,
        ))  # fmt: skip
        deadline = time.monotonic() + 30
        while (info := registry.get("reward", "reward-0")) is None or "step1-0" not in info.activity:
            assert time.monotonic() < deadline, "the heartbeat never said the server was scoring"
            await asyncio.sleep(0.1)
        assert info.activity == "reward.score job step1-0"
        proc.send_signal(signal.SIGTERM)
        reply = await scoring
        assert isinstance(reply, ScoreResult) and reply.scores == [1.0]  # answered, not torn down
        assert proc.wait(timeout=60) == 0
        log = (tmp_path / "reward-0.log").read_text()
        assert "draining: 1 request(s) in progress" in log, log[-2000:]

        proc = serve(tmp_path, config, "reward-0")
        deadline = time.monotonic() + 120
        while True:
            try:
                stats = await client.request(own, RewardStatsRequest(), timeout=5)
                break
            except Exception:  # noqa: BLE001 - not up yet (no responders / timeout)
                assert time.monotonic() < deadline and proc.poll() is None, (
                    tmp_path / "reward-0.log"
                ).read_text()
                await asyncio.sleep(0.5)
        assert isinstance(stats, RewardStats)
        assert stats.endpoints["run/made"].spec_version == made.spec_version
    finally:
        stop(proc)
        await registry.stop()
        await client.close()
        await store.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_two_replicas_one_killed_mid_score_the_resend_is_answered_by_the_other(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """The server's half of "a replica dying costs a retry": the request the killed replica held gets
    no answer (the controller's retry sends it again), the resend and every later request are
    answered by the survivor."""
    (tmp_path / "slow_reward.py").write_text(SLOW)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name in ("reward-a", "reward-b"):
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({
            "fleet": {"nats_url": nats_server.url, "cluster": CLUSTER + "-2"}, "worker_id": name,
            "quota_store": "process", "heartbeat_s": 0.5, "endpoints": {"slow": "slow_reward:slow:seconds=2"},
        }))  # fmt: skip
        procs[name] = serve(tmp_path, config, name)
    store = TensorStoreServer()
    await store.start()
    batch = RolloutBatch.from_rows(prompts=[[1, 2]], responses=[[3]], logprobs=[[0.0]], group_index=[0],
                                   pad_id=0, prompt_text=["p"], response_text=["x"])  # fmt: skip
    ref = store.put_local("batch-0", batch.to_tensors())
    client = await NatsTransport.connect(nats_server.url, name="test", tier="controller")
    registry = WorkerRegistry(client, CLUSTER + "-2")
    await registry.start()
    verb = subject(CLUSTER + "-2", "reward", "score")
    try:
        await registry.wait_for("reward", 2, timeout=120)
        first = asyncio.create_task(
            client.request(verb, ScoreRequest(job_id="step1-0", endpoint="slow", rollout=ref), timeout=8)
        )
        deadline = time.monotonic() + 30
        while not (busy := [w for w in registry.workers("reward") if "step1-0" in w.activity]):
            assert time.monotonic() < deadline, "no heartbeat named the request"
            await asyncio.sleep(0.1)
        victim = busy[0].worker_id
        procs[victim].kill()  # kill -9 mid-score
        procs[victim].wait(timeout=10)
        with pytest.raises(RequestTimeout):
            await first
        again = ScoreRequest(job_id="step1-0", endpoint="slow", rollout=ref)
        replies = await asyncio.gather(*(client.request(verb, again, timeout=30) for _ in range(3)))
        assert all(isinstance(r, ScoreResult) and r.scores == [1.0] for r in replies)
        survivor = next(name for name in procs if name != victim)
        assert procs[survivor].poll() is None
    finally:
        for proc in procs.values():
            stop(proc)
        await registry.stop()
        await client.close()
        await store.stop()
