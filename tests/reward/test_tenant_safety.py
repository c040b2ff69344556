"""A shared reward server's guards against its tenants, on an in-process transport and a real TensorStore.

A tenant may not load code (``module:function``) unless the operator admits the module, may not
swap its spec without ``can_update``, may not shut the server down, may not name a store outside
its ``stores``, is counted on every request, is held to its concurrency cap (so another tenant
still gets served), and its ``max_batch`` is checked before any text is fetched.
"""

from __future__ import annotations

import asyncio
import textwrap
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.control.messages import (
    Ack,
    RewardSpecSet,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
    Shutdown,
)
from rlfleet.common.control.transport import TOKEN_HEADER, subject
from rlfleet.common.errors import RemoteError

pytestmark = pytest.mark.timeout(60)

SCORE = subject("test", "reward", "score")
OWN = subject("test", "reward", "worker.reward-0")
TOKEN_A, TOKEN_B, ADMIN = "token-of-team-a", "token-of-team-b", "the-admin-token"
EXPLOIT = "timeit:timeit:number=1"
"""A standard-library function that runs its first argument (the prompt) as Python code."""


def config(**tenant_a: Any) -> dict[str, Any]:
    return {
        "endpoints": {"a/digits": "charset:allowed=0123456789", "b/short": "concise:max_words=2"},
        "tenants": [
            {"name": "team-a", "token": TOKEN_A, "endpoints": ["a/digits"], **tenant_a},
            {"name": "team-b", "token": TOKEN_B, "endpoints": ["b/short"]},
        ],
        "admin": {"token": ADMIN},
    }


async def ask(client, target: str, message, token: str, timeout: float = 10):
    return await client.request(target, message, timeout=timeout, headers={TOKEN_HEADER: token})


async def refused(client, target: str, message, token: str, code: str) -> str:
    with pytest.raises(RemoteError) as info:
        await ask(client, target, message, token)
    assert info.value.code == code, info.value
    return str(info.value)


def marker_prompt(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


async def test_a_tenant_cannot_make_the_server_run_code(reward_server, rollout_store, tmp_path: Path) -> None:
    client, _ = await reward_server(config(can_update=True))
    marker = tmp_path / "ran"
    ref = rollout_store.put([marker_prompt(marker)], ["pass"], [0])
    for spec in (EXPLOIT, f"0.5*concise + 0.5*{EXPLOIT}",
                 {"components": [{"name": "timeit:timeit", "args": {"number": 1}}]}):  # fmt: skip
        text = await refused(client, OWN, SetRewardSpec(endpoint="a/digits", spec=spec), TOKEN_A, "forbidden")
        assert "may not load code 'timeit:timeit'" in text and "allowed_modules" in text
    await ask(client, SCORE, ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref), TOKEN_A)
    assert not marker.exists(), "the tenant's code ran"
    # The same spec from the operator still loads (operators' own code is trusted): the refusal is the guard.
    done = await ask(client, OWN, SetRewardSpec(endpoint="a/digits", spec=EXPLOIT), ADMIN)
    assert isinstance(done, RewardSpecSet)
    await ask(client, SCORE, ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref), TOKEN_A)
    assert marker.exists()


async def test_can_update_is_off_by_default(reward_server) -> None:
    client, _ = await reward_server(config())
    text = await refused(
        client, OWN, SetRewardSpec(endpoint="a/digits", spec="concise"), TOKEN_A, "forbidden"
    )
    assert "may not update the reward of 'a/digits'" in text


async def test_the_operator_may_admit_a_module(
    reward_server, rollout_store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"vetted_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "def length(prompt, response, **metadata):\n    return len(response)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    client, _ = await reward_server({**config(can_update=True), "allowed_modules": [module]})
    done = await ask(client, OWN, SetRewardSpec(endpoint="a/digits", spec=f"{module}:length"), TOKEN_A)
    assert isinstance(done, RewardSpecSet) and done.spec == f"{module}:length"
    ref = rollout_store.put(["p"], ["abc"], [0])
    scored = await ask(client, SCORE, ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref), TOKEN_A)
    assert scored.scores == [3.0]
    text = await refused(client, OWN, SetRewardSpec(endpoint="a/digits", spec=EXPLOIT), TOKEN_A, "forbidden")
    assert f"admitted modules: ['{module}']" in text  # only the listed module, not the rest


async def test_only_the_admin_shuts_a_shared_server_down(reward_server, rollout_store) -> None:
    client, worker = await reward_server(config())
    text = await refused(client, OWN, Shutdown(reason="bye"), TOKEN_A, "forbidden")
    assert "shut the reward server down" in text and "admin token" in text
    await refused(client, OWN, Shutdown(reason="bye"), "", "missing_token")
    await refused(client, OWN, Shutdown(reason="bye"), "token-of-nobody", "invalid_token")
    ref = rollout_store.put(["p"], ["1"], [0])
    scored = await ask(client, SCORE, ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref), TOKEN_A)
    assert scored.scores == [1.0], "the server goes on after the refusals"
    assert isinstance(await ask(client, OWN, Shutdown(reason="maintenance"), ADMIN), Ack)
    await asyncio.wait_for(worker.serve_forever(), timeout=5)


async def test_an_open_server_still_stops_on_shutdown(reward_server) -> None:
    client, worker = await reward_server({"endpoints": {"e": "concise"}})
    assert isinstance(await client.request(OWN, Shutdown(reason="run over"), timeout=10), Ack)
    await asyncio.wait_for(worker.serve_forever(), timeout=5)


async def test_a_tenant_fetches_only_from_its_own_stores(reward_server, rollout_store) -> None:
    client, _ = await reward_server(config(stores=["10.20.*:*"]))
    ref = rollout_store.put(["p"], ["1"], [0])
    text = await refused(client, SCORE, ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref), TOKEN_A,
                         "forbidden")  # fmt: skip
    assert f"may not fetch rollouts from {ref.address!r}" in text and "10.20.*:*" in text
    host = ref.address.rpartition(":")[0]
    client2, _ = await reward_server(config(stores=[f"{host}:*"]))
    scored = await ask(client2, SCORE, ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref), TOKEN_A)
    assert scored.scores == [1.0]


async def test_max_batch_is_checked_before_any_text_is_fetched(reward_server, rollout_store) -> None:
    import numpy as np

    client, _ = await reward_server(config(max_batch=4))
    # Only the sample count is stored: a request fetching texts first would fail on the missing tensors.
    ref = rollout_store.server.put_local("counts-only", {"group_index": np.zeros(5, dtype=np.int64)})
    text = await refused(client, SCORE, ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref), TOKEN_A,
                         "batch_too_large")  # fmt: skip
    assert "5 samples" in text


async def test_every_tenant_request_counts_against_its_quota(reward_server, rollout_store) -> None:
    client, _ = await reward_server(config(requests_per_s=0.01, burst=2, can_update=True))
    await ask(client, OWN, RewardStatsRequest(), TOKEN_A)
    await ask(client, OWN, SetRewardSpec(endpoint="a/digits", spec="charset:allowed=01"), TOKEN_A)
    ref = rollout_store.put(["p"], ["1"], [0])
    over = [
        (SCORE, ScoreRequest(job_id="j", endpoint="a/digits", rollout=ref)),
        (OWN, RewardStatsRequest()),
        (OWN, SetRewardSpec(endpoint="a/digits", spec="concise")),
    ]
    for target, message in over:
        await refused(client, target, message, TOKEN_A, "quota_exceeded")
    scored = await ask(client, SCORE, ScoreRequest(job_id="j", endpoint="b/short", rollout=ref), TOKEN_B)
    assert scored.scores == [1.0], "team-a's quota is not team-b's"


async def test_a_busy_tenant_cannot_starve_another(
    reward_server, rollout_store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_concurrency 2, two tenants: one slot each by default; team-a's slow request holds its own only."""
    module = f"slow_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent("""
        import threading
        release = threading.Event()
        def wait(prompt, response, **metadata):
            release.wait(30)
            return 1.0
    """))  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config()
    cfg["endpoints"]["a/digits"] = f"{module}:wait"  # the operator's own function
    cfg["max_concurrency"] = 2
    client, _ = await reward_server(cfg)
    import importlib

    release: threading.Event = importlib.import_module(module).release
    ref = rollout_store.put(["p"], ["1"], [0])
    slow = asyncio.create_task(
        ask(client, SCORE, ScoreRequest(job_id="a1", endpoint="a/digits", rollout=ref), TOKEN_A, timeout=40)
    )
    try:
        await asyncio.sleep(0.5)
        text = await refused(client, SCORE, ScoreRequest(job_id="a2", endpoint="a/digits", rollout=ref),
                             TOKEN_A, "quota_exceeded")  # fmt: skip
        assert "already has 1 requests in progress" in text
        scored = await ask(client, SCORE, ScoreRequest(job_id="b1", endpoint="b/short", rollout=ref), TOKEN_B)
        assert scored.scores == [1.0] and not slow.done()
    finally:
        release.set()
    result = await slow
    assert isinstance(result, ScoreResult) and result.scores == [1.0]
    again = await ask(client, SCORE, ScoreRequest(job_id="a3", endpoint="a/digits", rollout=ref), TOKEN_A)
    assert again.scores == [1.0], "the slot is given back"
