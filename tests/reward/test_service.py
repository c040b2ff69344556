"""The reward worker with tenants, on an in-process transport and a real TensorStore.

Each refusal must come back as its own ErrorReply code; no tenant may score on, swap or see the
statistics of another tenant's endpoint.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.control.messages import (
    RewardSpecSet,
    RewardStats,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
)
from rlfleet.common.control.transport import TOKEN_HEADER, subject
from rlfleet.common.errors import RemoteError

pytestmark = pytest.mark.timeout(60)

SCORE = subject("test", "reward", "score")
OWN = subject("test", "reward", "worker.reward-0")
JOB_IDS = itertools.count()
TOKEN_A, TOKEN_B, ADMIN = "token-of-team-a", "token-of-team-b", "the-admin-token"

CONFIG: dict[str, Any] = {
    "endpoints": {
        "a/digits": {"spec": "charset:allowed=0123456789", "scaler": {"temperature": 0.5, "min_reward": 0.1}},
        "b/short": "concise:max_words=2",
    },
    "tenants": [
        {"name": "team-a", "token": TOKEN_A, "endpoints": ["a/digits"], "max_batch": 4, "can_update": True},
        {"name": "team-b", "token": TOKEN_B, "endpoints": ["b/short"], "requests_per_s": 1, "burst": 2},
    ],
    "admin": {"token": ADMIN},
}


async def score(client, ref, endpoint: str, token: str) -> ScoreResult:
    """One scoring, under a job id of its own (a repeated job id is answered from its first reply)."""
    request = ScoreRequest(job_id=f"j-{next(JOB_IDS)}", endpoint=endpoint, rollout=ref, token=token)
    reply = await client.request(SCORE, request, timeout=10)
    assert isinstance(reply, ScoreResult)
    return reply


async def refused(client, message, code: str, target: str = SCORE) -> str:
    with pytest.raises(RemoteError) as info:
        await client.request(target, message, timeout=10)
    assert info.value.code == code, info.value
    return str(info.value)


async def test_each_tenant_scores_on_its_own_endpoint_with_its_scaler(reward_server, rollout_store) -> None:
    client, _ = await reward_server(CONFIG)
    ref = rollout_store.put(["p", "p"], ["123", "12ab"], [0, 0])
    a = await score(client, ref, "a/digits", TOKEN_A)
    assert a.raw_scores == [1.0, 0.5] and a.scores == [2.0, 1.0] and a.components == {"charset": [1.0, 0.5]}
    assert a.spec_version.endswith("-r0")
    b = await score(client, ref, "b/short", TOKEN_B)
    assert b.scores == [1.0, 1.0] and b.raw_scores == []


async def test_tokens_and_endpoints_are_enforced_each_with_its_code(reward_server, rollout_store) -> None:
    client, _ = await reward_server(CONFIG)
    ref = rollout_store.put(["p"], ["1"], [0])
    await refused(client, ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref), "missing_token")
    bad = ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref, token="token-of-nobody")
    await refused(client, bad, "invalid_token")
    cross = ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref, token=TOKEN_B)
    text = await refused(client, cross, "forbidden_endpoint")
    assert "a/digits" in text and "['b/short']" in text
    ghost = ScoreRequest(job_id="j", endpoint="c/secret", rollout=ref, token=TOKEN_B)
    assert "b/short" in await refused(client, ghost, "forbidden_endpoint")  # existence is not revealed
    swap = SetRewardSpec(endpoint="a/digits", spec="concise", token=TOKEN_B)
    await refused(client, swap, "forbidden_endpoint", OWN)
    stats = RewardStatsRequest(token=TOKEN_B, endpoint="a/digits")
    await refused(client, stats, "forbidden_endpoint", OWN)


async def test_the_token_travels_in_its_header(reward_server, rollout_store) -> None:
    """Protocol 1.2: ``Rlfleet-Token`` header; the body's ``token`` (1.1 clients) only without one."""
    client, _ = await reward_server(CONFIG)
    ref = rollout_store.put(["p"], ["12"], [0])
    request = ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref)
    reply = await client.request(SCORE, request, timeout=10, headers={TOKEN_HEADER: TOKEN_A})
    assert isinstance(reply, ScoreResult) and reply.raw_scores == [1.0]
    with pytest.raises(RemoteError) as info:  # the header wins over a body token
        await client.request(SCORE, request.model_copy(update={"token": TOKEN_A}), timeout=10,
                             headers={TOKEN_HEADER: TOKEN_B})  # fmt: skip
    assert info.value.code == "forbidden_endpoint"
    with pytest.raises(RemoteError) as info:
        await client.request(SCORE, request, timeout=10, headers={TOKEN_HEADER: "token-of-nobody"})
    assert info.value.code == "invalid_token"
    stats = await client.request(OWN, RewardStatsRequest(), timeout=10, headers={TOKEN_HEADER: TOKEN_B})
    assert isinstance(stats, RewardStats) and set(stats.endpoints) == {"b/short"}


async def test_quotas_per_tenant(reward_server, rollout_store) -> None:
    client, _ = await reward_server(CONFIG)
    small, big = (
        rollout_store.put(["p"] * 4, ["1"] * 4, [0] * 4),
        rollout_store.put(["p"] * 5, ["1"] * 5, [0] * 5),
    )
    await score(client, small, "a/digits", TOKEN_A)
    text = await refused(client, ScoreRequest(job_id="j", endpoint="a/digits", rollout=big, token=TOKEN_A),
                         "batch_too_large")  # fmt: skip
    assert "5 samples" in text
    await score(client, small, "b/short", TOKEN_B)
    await score(client, small, "b/short", TOKEN_B)  # burst 2
    with pytest.raises(RemoteError) as over:
        await score(client, small, "b/short", TOKEN_B)
    assert over.value.code == "quota_exceeded" and over.value.retryable
    for _ in range(5):
        await score(client, small, "a/digits", TOKEN_A)  # team-b's quota is not team-a's


async def test_statistics_show_only_the_tenants_own(reward_server, rollout_store) -> None:
    client, _ = await reward_server(CONFIG)
    ref = rollout_store.put(["p", "p"], ["1", "x"], [0, 0])
    await score(client, ref, "a/digits", TOKEN_A)
    await score(client, ref, "b/short", TOKEN_B)
    await refused(client, ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref, token=TOKEN_B),
                  "forbidden_endpoint")  # fmt: skip
    mine = await client.request(OWN, RewardStatsRequest(token=TOKEN_A), timeout=10)
    assert isinstance(mine, RewardStats) and mine.tenant == "team-a"
    assert list(mine.endpoints) == ["a/digits"] and mine.refused == {}
    stats = mine.endpoints["a/digits"]
    assert (stats.requests, stats.samples, stats.raw_mean) == (1, 2, 0.5)
    assert stats.scaler["temperature"] == 0.5 and stats.scaler_state == {"count": 0, "mean": 0.0, "m2": 0.0}
    theirs = await client.request(OWN, RewardStatsRequest(token=TOKEN_B), timeout=10)
    assert list(theirs.endpoints) == ["b/short"] and theirs.refused == {"forbidden_endpoint": 1}
    admin = await client.request(OWN, RewardStatsRequest(token=ADMIN), timeout=10)
    assert sorted(admin.endpoints) == ["a/digits", "b/short"] and admin.refused == {
        "team-b/forbidden_endpoint": 1
    }


async def test_swaps_by_tenant_and_admin(reward_server, rollout_store) -> None:
    client, _ = await reward_server(CONFIG)
    ref = rollout_store.put(["p"], ["12 ab"], [0])
    done = await client.request(OWN, SetRewardSpec(endpoint="a/digits", spec="concise:max_words=1",
                                                   token=TOKEN_A), timeout=30)  # fmt: skip
    assert isinstance(done, RewardSpecSet) and done.spec_version.endswith("-r1")
    assert (
        done.previous_version.endswith("-r0")
        and done.spec.startswith("concise:")
        and "max_words=1" in done.spec
    )
    after = await score(client, ref, "a/digits", TOKEN_A)
    assert after.spec_version == done.spec_version and after.raw_scores == [0.0]  # the scaler stayed
    await refused(client, SetRewardSpec(endpoint="b/short", spec="concise", token=TOKEN_B), "forbidden", OWN)
    create = SetRewardSpec(endpoint="new/one", spec="keyword:keywords=ab", token=TOKEN_A)
    await refused(client, create, "forbidden_endpoint", OWN)
    created = await client.request(OWN, create.model_copy(update={"token": ADMIN}), timeout=30)
    assert created.spec_version.endswith("-r0") and created.previous_version == ""
    broken = SetRewardSpec(endpoint="a/digits", spec="concise:max_words=-1", token=TOKEN_A)
    await refused(client, broken, "bad_request", OWN)
    still = await score(client, ref, "a/digits", TOKEN_A)
    assert still.spec_version == done.spec_version, "a failed swap leaves the old version serving"


async def test_model_path_swap_keeps_the_rest_of_the_spec(reward_server, rollout_store, make_tiny_rm) -> None:
    first, second = make_tiny_rm(num_labels=1, seed=0), make_tiny_rm(num_labels=1, seed=5)
    client, _ = await reward_server({"endpoints": {"e": f"rm:path={first} + 0.5*concise:max_words=3"}})
    ref = rollout_store.put(["q", "q"], ["hello there", "a b c d e f"], [0, 0])
    before = await score(client, ref, "e", "")
    done = await client.request(OWN, SetRewardSpec(endpoint="e", model_path=str(second)), timeout=60)
    assert f"path={second}" in done.spec and "0.5*concise" in done.spec
    after = await score(client, ref, "e", "")
    assert after.components["concise"] == before.components["concise"]
    assert after.components["rm"] != before.components["rm"]
    text = await refused(client, SetRewardSpec(endpoint="e", model_path=str(first), component="other"),
                         "bad_request", OWN)  # fmt: skip
    assert "no rm component labelled 'other'" in text


async def test_state_dir_keeps_swapped_specs_and_statistics(
    reward_server, rollout_store, tmp_path: Path
) -> None:
    config = {"endpoints": {"e": {"spec": "charset:allowed=1", "scaler": {"normalize": True}}},
              "state_dir": str(tmp_path)}  # fmt: skip
    client, worker = await reward_server(config)
    ref = rollout_store.put(["p", "p"], ["1", "x"], [0, 0])
    await client.request(OWN, SetRewardSpec(endpoint="e", spec="charset:allowed=x"), timeout=30)
    await score(client, ref, "e", "")
    await worker.stop("restart")
    client2, _ = await reward_server(config)
    stats = await client2.request(OWN, RewardStatsRequest(), timeout=10)
    restored = stats.endpoints["e"]
    assert restored.spec.startswith("charset:allowed=x") and restored.spec_version.endswith("-r1")
    assert restored.scaler_state["count"] == 2
