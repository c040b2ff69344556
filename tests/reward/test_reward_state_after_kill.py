"""A reward worker killed with SIGKILL comes back with its run-time state (issue 12, point 5).

A real ``rlfleet-reward serve`` process on a real nats-server scores batches from a real
TensorStore on an endpoint with a normalizing :class:`RewardScaler` and a tiny reward model, gets
its reward model swapped (``update_reward_model``'s ``model_path`` swap), scores again, and is
killed with SIGKILL. Started again on the same ``state_dir`` (what the embedded launcher does),
it serves the swapped model at the same version and its scaler's running statistics as of the
last batch it answered (the periodic save is set to an hour, so only the per-batch save can
provide them), and the next batch is scaled with those statistics. A state file a hostile peer
replaced stops the process with exit 2 and a :class:`RewardStateError` naming the file.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.messages import (
    EndpointStats,
    RewardSpecSet,
    RewardStats,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
)
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject, worker_subject
from rlfleet.reward import RewardScaler

CLUSTER = "reward-state-kill"
RESPONSES = ["12", "1x", "abc", "7", "99", "q"]


async def _stats(client: NatsTransport, own: str, proc: subprocess.Popen[bytes], log: Path) -> EndpointStats:
    """The endpoint's statistics once the (re)started process answers."""
    deadline = time.monotonic() + 120
    while True:
        try:
            reply = await client.request(own, RewardStatsRequest(endpoint="e"), timeout=5)
            assert isinstance(reply, RewardStats)
            return reply.endpoints["e"]
        except Exception:  # noqa: BLE001 - not up yet (no responders / timeout)
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            await asyncio.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_killed_reward_worker_comes_back_with_its_model_and_scaler_statistics(
    nats_server: EmbeddedNats,
    tmp_path: Path,
    rollout_store: Any,
    spawn: Any,
    make_tiny_rm: Callable[..., Path],
) -> None:
    rm1, rm2 = make_tiny_rm(num_labels=1, seed=3), make_tiny_rm(num_labels=1, seed=4)
    state = tmp_path / "state"
    config = tmp_path / "reward.yaml"
    config.write_text(yaml.safe_dump({
        "fleet": {"nats_url": nats_server.url, "cluster": CLUSTER}, "worker_id": "reward-0",
        "quota_store": "process", "heartbeat_s": 0.5, "state_dir": str(state), "state_save_s": 3600,
        "endpoints": {"e": {"spec": f"charset:allowed=0123456789 + 0.5*rm:path={rm1}",
                            "scaler": {"normalize": True, "temperature": 0.5}}},
    }))  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    client = await NatsTransport.connect(nats_server.url, name="test", tier="controller")
    registry = WorkerRegistry(client, CLUSTER)
    await registry.start()
    own, score = worker_subject(CLUSTER, "reward", "reward-0"), subject(CLUSTER, "reward", "score")

    async def score_batch(job: str, responses: list[str]) -> ScoreResult:
        ref = rollout_store.put(["p"] * len(responses), responses, list(range(len(responses))))
        reply = await client.request(score, ScoreRequest(job_id=job, endpoint="e", rollout=ref), timeout=60)
        assert isinstance(reply, ScoreResult)
        return reply

    try:
        proc = spawn.serve("reward-0", config, env=env)
        await registry.wait_for("reward", 1, timeout=120)
        for i in range(2):
            await score_batch(f"before-{i}", RESPONSES[i:])
        swap = SetRewardSpec(endpoint="e", model_path=str(rm2))  # update_reward_model(rm2)
        swapped = await client.request(own, swap, timeout=120)
        assert isinstance(swapped, RewardSpecSet) and f"path={rm2}" in swapped.spec
        await score_batch("after-swap", RESPONSES[::-1])  # folded in after the swap's own save
        before = await _stats(client, own, proc, spawn.log_path("reward-0"))
        assert before.scaler_state is not None and before.scaler_state["count"] == 6 + 5 + 6, before

        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        proc = spawn.serve("reward-0", config, env=env)  # what the launcher does: same config
        after = await _stats(client, own, proc, spawn.log_path("reward-0"))
        assert after.spec == before.spec and f"path={rm2}" in after.spec, "the swapped model, not rm1"
        assert after.spec_version == before.spec_version == swapped.spec_version
        assert after.scaler == before.scaler
        assert after.scaler_state == before.scaler_state, "the statistics as of the last batch answered"

        expected = RewardScaler(normalize=True, temperature=0.5)
        expected.load_state_dict(before.scaler_state)
        again = await score_batch("after-restart", RESPONSES)
        assert again.spec_version == before.spec_version
        assert again.scores == pytest.approx(expected(again.raw_scores)), "scaled on from where it was"
    finally:
        await registry.stop()
        await client.close()


@pytest.mark.timeout(120)
def test_a_hostile_state_file_stops_the_worker_naming_the_file(
    nats_server: EmbeddedNats, tmp_path: Path, spawn: Any
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "e.json").write_text('{"endpoint": "e", "spec": "charset:allowed=1", "revision": 0, '
                                  '"scaler_state": {"count": -4, "mean": 0, "m2": 0}}')  # fmt: skip
    config = tmp_path / "reward.yaml"
    config.write_text(yaml.safe_dump({
        "fleet": {"nats_url": nats_server.url, "cluster": CLUSTER + "-bad"}, "worker_id": "reward-0",
        "quota_store": "process", "state_dir": str(state), "endpoints": {"e": "charset:allowed=1"},
    }))  # fmt: skip
    proc = spawn.serve("reward-0", config, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.wait(timeout=100) == 2, spawn.log("reward-0")[-3000:]
    log = spawn.log("reward-0")
    assert "RewardStateError" in log and str(state / "e.json") in log, log[-3000:]
    assert "Traceback" not in log, "a named error, not a crash"
