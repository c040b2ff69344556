"""Tenants: token sources, who a token is, quotas on a fake clock, endpoint rights; deploy/reward.yaml."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.config import load_config
from rlfleet.common.schema.reward import RewardWorkerConfig
from rlfleet.reward.errors import (
    BatchTooLarge,
    ForbiddenEndpoint,
    ForbiddenOperation,
    InvalidToken,
    MissingToken,
    QuotaExceeded,
)
from rlfleet.reward.quota_store import TokenBucket
from rlfleet.reward.registry import parse_reward_spec
from rlfleet.reward.tenants import TenantConfig, TenantTable, TokenSource

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "reward.yaml"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(clock: Clock | None = None) -> TenantTable:
    digest_b = hashlib.sha256(b"token-of-team-b").hexdigest()
    return TenantTable(
        [
            TenantConfig(
                name="a",
                token="token-of-team-a",
                endpoints=["a/1"],
                requests_per_s=2.0,
                max_batch=8,
                can_update=True,
            ),
            TenantConfig(name="b", token_sha256=digest_b, endpoints=["b/1"]),  # can_update: off by default
        ],
        admin=TokenSource(token="the-admin-token"),
        clock=clock or Clock(),
    )


def test_tokens_name_their_tenant_and_nothing_else() -> None:
    t = table()
    assert t.identify("token-of-team-a", "score").name == "a"
    assert t.identify("token-of-team-b", "score").name == "b"  # from its sha256 only
    assert t.identify("the-admin-token", "score") is None and t.is_admin("the-admin-token")
    assert not t.is_admin("token-of-team-a")
    with pytest.raises(MissingToken) as missing:
        t.identify("", "score on 'a/1'")
    assert missing.value.code == "missing_token"
    with pytest.raises(InvalidToken) as invalid:
        t.identify("token-of-team-a ", "score")
    assert invalid.value.code == "invalid_token" and "token-of" not in str(invalid.value)


def test_an_open_server_accepts_everyone() -> None:
    t = TenantTable([])
    assert t.open and t.identify("", "score") is None and t.is_admin("")
    t.check_endpoint(None, "anything")


def test_endpoint_rights_and_visibility() -> None:
    t = table()
    a, b = t.identify("token-of-team-a", "x"), t.identify("token-of-team-b", "x")
    t.check_endpoint(a, "a/1")
    with pytest.raises(ForbiddenEndpoint, match="'a' may not use endpoint 'b/1'") as refused:
        t.check_endpoint(a, "b/1")
    assert refused.value.code == "forbidden_endpoint" and a.refused == {"forbidden_endpoint": 1}
    with pytest.raises(ForbiddenOperation):
        t.check_update(b, "b/1")  # can_update: false
    t.check_update(a, "a/1")
    assert t.visible(a, ["a/1", "b/1", "c"]) == ["a/1"]
    assert t.visible(None, ["b/1", "a/1"]) == ["a/1", "b/1"]


async def test_quota_is_a_token_bucket() -> None:
    clock = Clock()
    t = table(clock)
    a = t.identify("token-of-team-a", "x")
    await t.take_request(a)
    await t.take_request(a)  # burst = ceil(2/s) = 2
    with pytest.raises(QuotaExceeded, match="retry in 0.50s") as over:
        await t.take_request(a)
    assert over.value.code == "quota_exceeded" and over.value.retryable
    clock.now += 0.5
    await t.take_request(a)
    b = t.identify("token-of-team-b", "x")
    for _ in range(100):
        await t.take_request(b)  # no rate set: no cap


def test_bucket_refills_up_to_its_capacity_only() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=10.0, capacity=3.0, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.1)
    clock.now += 60
    assert [bucket.take() == 0.0 for _ in range(4)] == [True, True, True, False]


def test_max_batch() -> None:
    t = table()
    a = t.identify("token-of-team-a", "x")
    t.check_batch(a, 8)
    with pytest.raises(BatchTooLarge, match="sent 9 samples.*max_batch is 8") as big:
        t.check_batch(a, 9)
    assert big.value.code == "batch_too_large"


async def test_code_stores_and_concurrency_are_refused_with_their_wire_codes_fields() -> None:
    tenant = TenantConfig(name="a", token="token-aa", endpoints=["a/1"], concurrency=1, stores=["10.0.*:*"])
    t = TenantTable([tenant], allowed_modules=["my_rewards"])
    a = t.identify("token-aa", "x")
    with pytest.raises(ForbiddenOperation, match="code 'os:system'.*allowed_modules.*my_rewards") as code:
        t.check_spec(a, parse_reward_spec("os:system"))
    assert code.value.code == "forbidden" and code.value.allowed == ["my_rewards"]
    t.check_spec(a, parse_reward_spec("my_rewards:score"))
    with pytest.raises(ForbiddenOperation, match=r"rollouts from '10.1.0.1:5'; its stores: \['10.0") as store:
        await t.admit_store(a, "10.1.0.1:5")
    assert store.value.code == "forbidden" and store.value.allowed == ["10.0.*:*"]
    assert (await t.admit_store(a, "10.0.3.4:5")).connect == "10.0.3.4:5"
    with t.slot(a), pytest.raises(QuotaExceeded, match="already has 1 requests in progress") as busy:
        with t.slot(a):
            pass
    assert busy.value.code == "quota_exceeded" and busy.value.retryable and busy.value.quota == "concurrency"
    assert busy.value.retry_after_s == 0.0
    assert a.refused == {"code_not_allowed": 1, "forbidden_store": 1, "tenant_busy": 1}


def test_token_sources_are_checked() -> None:
    with pytest.raises(ValidationError, match="exactly one of"):
        TokenSource(token="long-enough", token_env="X")
    with pytest.raises(ValidationError, match="exactly one of"):
        TokenSource()
    with pytest.raises(ValidationError, match="64 lowercase hex"):
        TokenSource(token_sha256="abc")
    with pytest.raises(ValidationError, match="at least 8"):
        TokenSource(token="short")
    with pytest.raises(ValueError, match="RLFLEET_TEST_UNSET_TOKEN is unset"):
        TokenSource(token_env="RLFLEET_TEST_UNSET_TOKEN").digest("tenant 'x'")
    with pytest.raises(ValueError, match="share a token"):
        TenantTable([TenantConfig(name="x", token="same-token"), TenantConfig(name="y", token="same-token")])


def test_config_refuses_tenants_on_unknown_endpoints() -> None:
    with pytest.raises(ConfigError, match="names endpoints \\['nope'\\]"):
        load_config(RewardWorkerConfig, data={"endpoints": {"e": "concise"},
                    "tenants": [{"name": "a", "token": "token-of-a", "endpoints": ["nope"]}]})  # fmt: skip


def test_deploy_example_loads_with_two_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(RewardWorkerConfig, DEPLOY)
    assert [t.name for t in config.tenants] == ["team-a", "team-b"]
    assert config.endpoints["team-a/helpful"].scaler.temperature == 0.7
    assert config.endpoints["team-a/digits"].spec == "charset:allowed=0123456789"
    for name, value in [("RLFLEET_TOKEN_TEAM_A", "aaaa-token"), ("RLFLEET_TOKEN_TEAM_B", "bbbb-token"),
                        ("RLFLEET_REWARD_ADMIN_TOKEN", "admin-token")]:  # fmt: skip
        monkeypatch.setenv(name, value)
    tenants = TenantTable(config.tenants, admin=config.admin)
    assert tenants.identify("bbbb-token", "x").config.endpoints == ["team-b/math"]
    assert tenants.is_admin("admin-token")
    from rlfleet.reward import build_reward

    for name, endpoint in config.endpoints.items():
        if "similarity" not in str(endpoint.spec):  # MiniLM loads in test_similarity.py
            assert build_reward(endpoint.spec).version, name
