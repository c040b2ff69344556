"""A resent score is answered from its first reply: a batch counts once in a scaler's statistics.

The controller resends a score whose reply it did not get (a timeout, a lost connection, a
retryable refusal) with the same job id, and the NATS transport resends one after an outage. The
reward worker must not score that batch twice: a normalizing scaler would count it twice and the
endpoint's statistics would be off. A job id reused for another batch, another tenant's job id or
a score after a hot swap is scored anew.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlfleet.common.control.messages import (
    RewardStats,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
)
from rlfleet.common.control.transport import subject

pytestmark = pytest.mark.timeout(60)

SCORE = subject("test", "reward", "score")
OWN = subject("test", "reward", "worker.reward-0")
TOKEN_A, TOKEN_B, ADMIN = "token-of-team-a", "token-of-team-b", "the-admin-token"
SCALED = {"spec": "charset:allowed=0123456789", "scaler": {"normalize": True}}
CONFIG: dict[str, Any] = {
    "endpoints": {"shared": SCALED},
    "tenants": [
        {"name": "team-a", "token": TOKEN_A, "endpoints": ["shared"], "can_update": True},
        {"name": "team-b", "token": TOKEN_B, "endpoints": ["shared"]},
    ],
    "admin": {"token": ADMIN},
}


async def scored(client, request: ScoreRequest) -> ScoreResult:
    reply = await client.request(SCORE, request, timeout=10)
    assert isinstance(reply, ScoreResult), reply
    return reply


async def counts(client) -> tuple[int, int]:
    """The endpoint's (requests scored, samples its scaler has seen)."""
    reply = await client.request(OWN, RewardStatsRequest(endpoint="shared", token=ADMIN), timeout=10)
    assert isinstance(reply, RewardStats), reply
    stats = reply.endpoints["shared"]
    assert stats.scaler_state is not None, stats
    return stats.requests, int(stats.scaler_state["count"])


async def test_a_resent_score_is_answered_once(reward_server, rollout_store) -> None:
    client, _ = await reward_server(CONFIG)
    ref = rollout_store.put(["p", "p"], ["123", "12ab"], [0, 0])
    request = ScoreRequest(job_id="step-3-score", endpoint="shared", rollout=ref, token=TOKEN_A)
    first = await scored(client, request)
    again = await scored(client, request)
    assert again == first
    assert await counts(client) == (1, 2)  # one batch of two samples, counted once


async def test_other_batches_tenants_and_versions_are_scored(reward_server, rollout_store) -> None:
    client, _ = await reward_server(CONFIG)
    ref = rollout_store.put(["p", "p"], ["123", "12ab"], [0, 0])
    other = rollout_store.put(["p"], ["9"], [0])
    await scored(client, ScoreRequest(job_id="j", endpoint="shared", rollout=ref, token=TOKEN_A))
    # the same job id for another batch (a client that reuses ids) is scored, not refused
    await scored(client, ScoreRequest(job_id="j", endpoint="shared", rollout=other, token=TOKEN_A))
    # another tenant's job ids are its own
    await scored(client, ScoreRequest(job_id="j", endpoint="shared", rollout=ref, token=TOKEN_B))
    assert await counts(client) == (3, 5)
    swap = SetRewardSpec(endpoint="shared", spec="charset:allowed=0123456789ab", token=TOKEN_A)
    await client.request(OWN, swap, timeout=30)
    after = await scored(client, ScoreRequest(job_id="j", endpoint="shared", rollout=ref, token=TOKEN_A))
    assert after.spec_version.endswith("-r1") and after.raw_scores == [1.0, 1.0]
