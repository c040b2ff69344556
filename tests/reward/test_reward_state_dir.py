"""A reward server's ``state_dir`` (issue 12, point 3): what it serves survives a restart.

Endpoints created at run time and hot swaps come back with their revision and scaler statistics;
a state file that is not JSON, not an endpoint state, or names another endpoint stops the server
with a :class:`RewardStateError` naming the file; a replica sharing the directory never replaces a
file with an older revision. In-process transport, real TensorStore, real state files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.common.control.messages import RewardStats, RewardStatsRequest, ScoreRequest, SetRewardSpec
from rlfleet.common.control.transport import subject
from rlfleet.reward.endpoint_state import StateDir
from rlfleet.reward.errors import RewardStateError

pytestmark = pytest.mark.timeout(60)
SCORE = subject("test", "reward", "score")
OWN = subject("test", "reward", "worker.reward-0")


def config(state: Path) -> dict[str, object]:
    return {"endpoints": {"e": "charset:allowed=1"}, "state_dir": str(state)}


async def test_created_and_swapped_endpoints_come_back(reward_server, rollout_store, tmp_path: Path) -> None:
    client, worker = await reward_server(config(tmp_path))
    made = SetRewardSpec(endpoint="run/new", spec="charset:allowed=x", scaler={"normalize": True})
    await client.request(OWN, made, timeout=30)
    await client.request(OWN, SetRewardSpec(endpoint="e", spec="concise:max_words=3"), timeout=30)
    ref = rollout_store.put(["p", "p"], ["x", "1"], [0, 0])
    await client.request(SCORE, ScoreRequest(job_id="j", endpoint="run/new", rollout=ref), timeout=10)
    assert sorted(StateDir(tmp_path).names()) == ["e", "run/new"]
    await worker.stop("restart")
    client2, _ = await reward_server(config(tmp_path))
    stats = await client2.request(OWN, RewardStatsRequest(), timeout=10)
    assert isinstance(stats, RewardStats)
    assert stats.endpoints["run/new"].spec.startswith("charset:allowed=x")
    assert stats.endpoints["run/new"].spec_version.endswith("-r0")
    assert stats.endpoints["run/new"].scaler_state["count"] == 2
    assert stats.endpoints["e"].spec.startswith("concise") and stats.endpoints["e"].spec_version.endswith(
        "-r1"
    )
    scored = await client2.request(
        SCORE, ScoreRequest(job_id="k", endpoint="run/new", rollout=ref), timeout=10
    )
    assert scored.spec_version.endswith("-r0")


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"spec": "charset:allowed=1", "revis', "not JSON"),
        ('{"spec": "charset:allowed=1", "revision": -3}', "revision"),
        ('{"endpoint": "other", "spec": "charset:allowed=1", "revision": 0}', "holds endpoint 'other'"),
        ('{"spec": "nonsense_rule", "revision": 0}', "no longer builds"),
        ('["a list"]', "not an endpoint state"),
    ],
)
async def test_a_bad_state_file_is_a_named_error(
    reward_server, tmp_path: Path, content: str, reason: str
) -> None:
    (tmp_path / "e.json").write_text(content)
    with pytest.raises(RewardStateError) as failed:
        await reward_server(config(tmp_path))
    assert str(tmp_path / "e.json") in str(failed.value) and reason in str(failed.value), failed.value


async def test_a_file_is_never_replaced_by_an_older_revision(reward_server, tmp_path: Path) -> None:
    _, worker = await reward_server(config(tmp_path))
    worker.endpoints.save()
    newer = json.loads((tmp_path / "e.json").read_text()) | {"spec": "concise", "revision": 5}
    (tmp_path / "e.json").write_text(json.dumps(newer))  # another replica's swap
    worker.endpoints.save()
    assert json.loads((tmp_path / "e.json").read_text())["revision"] == 5
    assert not list(tmp_path.glob(".*.tmp"))  # no partial file left behind
