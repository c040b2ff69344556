"""Hot swap while requests keep coming: no request fails, versions only move forward, and a
request in flight finishes on the version it started with."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import types
from collections.abc import Iterator

import pytest

from rlfleet.common.control.messages import RewardSpecSet, ScoreRequest, ScoreResult, SetRewardSpec
from rlfleet.common.control.transport import subject
from rlfleet.reward.endpoints import revision_of

pytestmark = pytest.mark.timeout(60)

SCORE = subject("test", "reward", "score")
OWN = subject("test", "reward", "worker.reward-0")
MODULE = "rlfleet_test_swap_rewards"
GATE = threading.Event()


def slow(prompt: str, response: str, *, delay: float = 0.002, value: float = 1.0) -> float:
    time.sleep(delay)
    return value


def gated(prompt: str, response: str) -> float:
    if not GATE.wait(timeout=20):
        raise TimeoutError("the test never opened the gate")
    return 7.0


@pytest.fixture
def user_module() -> Iterator[str]:
    """The reward functions above, importable as ``rlfleet_test_swap_rewards:<name>``."""
    module = types.ModuleType(MODULE)
    module.slow, module.gated = slow, gated  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
    GATE.clear()
    yield MODULE
    GATE.set()
    del sys.modules[MODULE]


async def test_steady_stream_through_swaps(reward_server, rollout_store, user_module: str) -> None:
    client, _ = await reward_server({"endpoints": {"e": f"{user_module}:slow"}, "max_concurrency": 8})
    ref = rollout_store.put(["p"] * 8, ["r"] * 8, [0] * 8)
    stop = asyncio.Event()
    seen: dict[int, list[int]] = {}
    failures: list[BaseException] = []

    async def stream(client_id: int) -> None:
        seen[client_id] = []
        while not stop.is_set():
            request = ScoreRequest(job_id=f"c{client_id}", endpoint="e", rollout=ref)
            try:
                reply = await client.request(SCORE, request, timeout=10)
            except Exception as exc:  # noqa: BLE001 - every failure is what this test counts
                failures.append(exc)
                continue
            assert isinstance(reply, ScoreResult)
            seen[client_id].append(revision_of(reply.spec_version))

    streams = [asyncio.create_task(stream(i)) for i in range(4)]
    await asyncio.sleep(0.2)
    for revision in range(1, 7):
        spec = f"{user_module}:slow:value={revision}" if revision % 2 else "concise:max_words=5"
        done = await client.request(OWN, SetRewardSpec(endpoint="e", spec=spec), timeout=30)
        assert isinstance(done, RewardSpecSet) and revision_of(done.spec_version) == revision
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*streams)

    assert failures == []
    for revisions in seen.values():
        assert len(revisions) > 10
        assert revisions == sorted(revisions), f"a client saw the version go back: {revisions}"
        assert revisions[-1] == 6
    assert set().union(*map(set, seen.values())) == set(range(7)), "every version served some requests"


async def test_request_in_flight_finishes_on_its_version(
    reward_server, rollout_store, user_module: str
) -> None:
    client, _ = await reward_server({"endpoints": {"e": f"{user_module}:gated"}})
    ref = rollout_store.put(["p"], ["r"], [0])
    early = asyncio.create_task(client.request(SCORE, ScoreRequest(job_id="early", endpoint="e", rollout=ref),
                                               timeout=30))  # fmt: skip
    await asyncio.sleep(0.3)  # the early request is now blocked inside the gated reward
    done = await client.request(OWN, SetRewardSpec(endpoint="e", spec="concise"), timeout=30)
    late = await client.request(SCORE, ScoreRequest(job_id="late", endpoint="e", rollout=ref), timeout=10)
    assert not early.done(), "the swap and the late request did not wait for the request in flight"
    GATE.set()
    first = await early
    assert isinstance(first, ScoreResult) and isinstance(late, ScoreResult)
    assert first.scores == [7.0] and revision_of(first.spec_version) == 0
    assert late.spec_version == done.spec_version and revision_of(late.spec_version) == 1
