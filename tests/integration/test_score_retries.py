"""The controller's score requests (``RewardControl``) against a real reward worker and TensorStore:
a tenant over its quota is answered ``QuotaExceeded`` with the wait it needs (``retry_after_s`` on
the wire), the controller waits that long and gets every score; a spent budget is a named failure;
a request that cannot succeed is not retried."""

from __future__ import annotations

import time

import pytest

from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.messages import GenerateResult, ScoreRequest
from rlfleet.common.control.transport import subject
from rlfleet.common.errors import RemoteError
from rlfleet.controller.errors import RetriesExhausted
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.reward_control import RewardControl

pytestmark = pytest.mark.timeout(60)

TOKEN = "token-of-team-b"
CONFIG = {
    "endpoints": {"b/short": "concise:max_words=2"},
    "tenants": [
        {"name": "team-b", "token": TOKEN, "endpoints": ["b/short"], "requests_per_s": 2, "burst": 1}
    ],
}


def _result(ref) -> GenerateResult:
    """What a rollout worker answers for a finished batch (only its ref is read for scoring)."""
    return GenerateResult(job_id="gen", worker_id="rollout-0", weight_version=0, ref=ref, num_prompts=1,
                          num_samples=2)  # fmt: skip


def _control(client, faults: FaultSettings) -> RewardControl:
    return RewardControl(client, "test", WorkerRegistry(client, "test"), token=TOKEN, request_timeout=10,
                         faults=faults)  # fmt: skip


async def test_quota_refusals_carry_their_wait_and_the_controller_honours_it(
    reward_server, rollout_store
) -> None:
    client, _ = await reward_server(CONFIG)
    ref = rollout_store.put(["p"] * 2, ["1", "one two three"], [0, 0])
    control = _control(
        client, FaultSettings(retry_attempts=6, retry_backoff_s=0.01, retry_backoff_max_s=0.01)
    )
    await control.score([_result(ref)], [[{}, {}]], "b/short", ["warm"])  # the burst of 1 is spent
    with pytest.raises(RemoteError) as over:
        request = ScoreRequest(job_id="raw", endpoint="b/short", rollout=ref, token=TOKEN)
        await client.request(subject("test", "reward", "score"), request, timeout=10)
    assert (
        over.value.code == "quota_exceeded" and over.value.retryable and 0 < over.value.retry_after_s <= 0.5
    )
    began = time.monotonic()
    scored = await control.score([_result(ref)] * 3, [[{}, {}]] * 3, "b/short", ["a", "b", "c"])
    took = time.monotonic() - began
    assert [s.job_id for s in scored] == ["a", "b", "c"] and all(len(s.scores) == 2 for s in scored)
    assert took >= 1.0, f"3 requests at 2/s after the burst took {took:.2f} s: retry_after was not honoured"


async def test_a_spent_budget_names_the_request_and_the_last_error(reward_server, rollout_store) -> None:
    client, _ = await reward_server(CONFIG)
    ref = rollout_store.put(["p"], ["1"], [0])
    control = _control(client, FaultSettings(retry_attempts=1))
    await control.score([_result(ref)], [[{}]], "b/short", ["first"])
    with pytest.raises(RetriesExhausted) as info:
        await control.score([_result(ref)], [[{}]], "b/short", ["second"])
    assert (
        info.value.attempts == 1 and "score second" in str(info.value) and "quota_exceeded" in str(info.value)
    )


async def test_a_refusal_that_cannot_pass_is_not_retried(reward_server, rollout_store) -> None:
    client, _ = await reward_server(CONFIG)
    ref = rollout_store.put(["p"], ["1"], [0])
    control = _control(client, FaultSettings(retry_attempts=5, retry_backoff_s=5.0, retry_backoff_max_s=5.0))
    began = time.monotonic()
    with pytest.raises(RemoteError) as info:
        await control.score([_result(ref)], [[{}]], "a/other", ["x"])
    assert not isinstance(info.value, RetriesExhausted) and time.monotonic() - began < 4.0
