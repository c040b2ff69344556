"""Tenants of a shared reward server against each other: what ``tests/reward`` does not try already.

On the reward tests' setup (a :class:`RewardWorker` with two tenants on an in-process transport,
real TensorStores over gRPC): team-a names team-b's rollout by its store address and key, which
its ``stores`` allow (one host), but without the capability team-b's store issued, or with a
capability of its own; and team-a scores on team-b's endpoint. Each is refused with an error
naming the problem, no text of team-b's reaches team-a, and both tenants are served afterwards.
"""

from __future__ import annotations

import pytest

from rlfleet.common.control.messages import ScoreRequest, ScoreResult
from rlfleet.common.control.transport import TOKEN_HEADER, subject
from rlfleet.common.errors import RemoteError

pytestmark = pytest.mark.timeout(60)

SCORE = subject("test", "reward", "score")
TOKEN_A, TOKEN_B = "token-of-team-a", "token-of-team-b"
SECRET = "31415926535"  # team-b's answer (digits: its endpoint scores it 1)


def shared(host: str) -> dict[str, object]:
    stores = [f"{host}:*"]  # both teams' stores on one host: the glob alone cannot tell them apart
    return {
        "endpoints": {"a/digits": "charset:allowed=0123456789", "b/digits": "charset:allowed=0123456789"},
        "tenants": [
            {"name": "team-a", "token": TOKEN_A, "endpoints": ["a/digits"], "stores": stores},
            {"name": "team-b", "token": TOKEN_B, "endpoints": ["b/digits"], "stores": stores},
        ],
        "admin": {"token": "the-admin-token"},
    }


async def score(client, endpoint: str, ref, token: str) -> ScoreResult:
    request = ScoreRequest(job_id="j", endpoint=endpoint, rollout=ref)
    return await client.request(SCORE, request, timeout=10, headers={TOKEN_HEADER: token})


async def refused(client, endpoint: str, ref, token: str, code: str) -> str:
    with pytest.raises(RemoteError) as info:
        await score(client, endpoint, ref, token)
    assert info.value.code == code, info.value
    assert SECRET not in str(info.value)
    return str(info.value)


async def test_a_tenant_cannot_read_another_tenants_rollout_by_its_address(
    reward_server, rollout_store
) -> None:
    theirs = rollout_store.put(["team-b's prompt"], [SECRET], [0])  # team-b's batch, team-b's ref
    ours = rollout_store.put(["p"], ["1"], [0])
    client, _ = await reward_server(shared(theirs.address.rpartition(":")[0]))
    forged = {
        "no capability": theirs.model_copy(update={"capability": ""}),
        "its own capability": theirs.model_copy(update={"capability": ours.capability}),
        "a guessed key": theirs.model_copy(update={"key": theirs.key.rsplit(".", 1)[0]}),
    }
    for what, ref in forged.items():
        text = await refused(client, "a/digits", ref, TOKEN_A, "forbidden")
        assert ref.key in text and "no valid capability" in text, what
    assert (await score(client, "a/digits", ours, TOKEN_A)).scores == [1.0]
    assert (await score(client, "b/digits", theirs, TOKEN_B)).scores == [1.0]  # team-b is unharmed


async def test_a_tenant_cannot_score_on_another_tenants_endpoint(reward_server, rollout_store) -> None:
    ref = rollout_store.put(["p"], ["7"], [0])
    client, _ = await reward_server(shared(ref.address.rpartition(":")[0]))
    text = await refused(client, "b/digits", ref, TOKEN_A, "forbidden_endpoint")
    assert "'team-a' may not use endpoint 'b/digits'" in text
    assert (await score(client, "b/digits", ref, TOKEN_B)).scores == [1.0]
