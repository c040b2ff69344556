"""A reward swap is all or nothing (issue 29, point 4): a swap that fails anywhere leaves the old
version serving whole, its reward and its scaler statistics alike.

A real reward worker on the in-process transport, real TensorStore, real state files and real
(tiny) reward models.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from rlfleet.common.control.messages import (
    RewardStats,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
)
from rlfleet.common.control.transport import subject
from rlfleet.common.errors import RemoteError

pytestmark = pytest.mark.timeout(120)
SCORE = subject("test", "reward", "score")
OWN = subject("test", "reward", "worker.reward-0")


async def _stats(client, name: str):  # noqa: ANN001, ANN202
    reply = await client.request(OWN, RewardStatsRequest(), timeout=10)
    assert isinstance(reply, RewardStats)
    return reply.endpoints[name]


async def test_a_swap_whose_state_cannot_be_saved_leaves_the_old_statistics(
    reward_server, rollout_store, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    client, _ = await reward_server({"endpoints": {}, "state_dir": str(state)})
    made = SetRewardSpec(endpoint="e", spec="charset:allowed=x", scaler={"normalize": True})
    await client.request(OWN, made, timeout=30)
    ref = rollout_store.put(["p", "p", "p"], ["x", "xx1", "1"], [0, 0, 0])
    first = await client.request(SCORE, ScoreRequest(job_id="j1", endpoint="e", rollout=ref), timeout=10)
    assert isinstance(first, ScoreResult)
    before = await _stats(client, "e")
    assert before.scaler_state is not None and before.scaler_state["count"] == 3

    saved = state / "e.json"  # the state can no longer be written: a directory stands where the file goes
    saved.unlink()
    saved.mkdir()
    (saved / "in-the-way").write_text("x")
    try:
        swap = SetRewardSpec(endpoint="e", scaler_state={"count": 50, "mean": 7.0, "m2": 100.0})
        with pytest.raises(RemoteError, match="e.json"):
            await client.request(OWN, swap, timeout=30)
        after = await _stats(client, "e")
        assert after.spec_version == before.spec_version
        assert after.scaler_state == before.scaler_state, "the failed swap changed the serving statistics"
    finally:
        shutil.rmtree(saved)
    # the old version still scales with its own statistics (folding this batch in)
    again = await client.request(SCORE, ScoreRequest(job_id="j2", endpoint="e", rollout=ref), timeout=10)
    assert isinstance(again, ScoreResult) and again.spec_version == first.spec_version
    assert (await _stats(client, "e")).scaler_state["count"] == 6


async def test_a_swap_whose_second_model_fails_to_load_keeps_the_old_reward(
    reward_server, rollout_store, make_tiny_rm: Callable[..., Path], tmp_path: Path
) -> None:
    good = make_tiny_rm(num_labels=1, seed=0)
    client, _ = await reward_server({"endpoints": {"e": f"rm:path={good}"}})
    ref = rollout_store.put(["p", "q"], ["a b", "c"], [0, 1])
    first = await client.request(SCORE, ScoreRequest(job_id="j1", endpoint="e", rollout=ref), timeout=30)
    assert isinstance(first, ScoreResult)
    before = await _stats(client, "e")

    broken = tmp_path / "broken-rm"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    swap = SetRewardSpec(endpoint="e", spec={"components": [
        {"name": "rm", "label": "first", "weight": 0.5, "args": {"path": str(good)}},
        {"name": "rm", "label": "second", "weight": 0.5, "args": {"path": str(broken)}},
    ]})  # fmt: skip
    with pytest.raises(RemoteError, match="broken-rm"):
        await client.request(OWN, swap, timeout=60)
    after = await _stats(client, "e")
    assert (after.spec, after.spec_version) == (before.spec, before.spec_version)
    again = await client.request(SCORE, ScoreRequest(job_id="j2", endpoint="e", rollout=ref), timeout=30)
    assert isinstance(again, ScoreResult)
    assert again.spec_version == first.spec_version and again.scores == first.scores
