"""Tenant quotas hold across reward server replicas: two real ``rlfleet-reward serve`` processes in one
queue group, on a real nats-server run with deploy/nats-server.conf (its users, permissions and
JetStream; TLS left out here, tests/integration/test_nats_auth_deploy.py covers it).

A tenant whose quota is 10 requests sends 20 at once, spread over both replicas by the queue group:
exactly 10 are scored and the other 10 are refused with a retryable ``quota_exceeded`` that says
when to retry; another tenant is served as before; the tenant cannot reset its count through the
key-value bucket (its NATS user may not reach JetStream). A replica whose NATS server has no
JetStream refuses to start, naming the problem.
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import RewardStats, RewardStatsRequest, ScoreRequest, ScoreResult
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import TOKEN_HEADER, subject, worker_subject
from rlfleet.common.errors import RemoteError
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.reward.quota_store import quota_bucket, quota_key

CONF = Path(__file__).resolve().parents[2] / "deploy" / "nats-server.conf"
USERS = ("controller", "trainer", "rollout", "reward", "reward-server", "admin", "team-a", "team-b")
TOKEN_A, TOKEN_B, ADMIN = "team-a-token-1111", "team-b-token-2222", "admin-token-3333"
REPLICAS = ("reward-r0", "reward-r1")
SCORE = subject("shared", "reward", "score")


def password(user: str) -> str:
    return f"pw-{user}-0123456789"


def env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


def write_config(where: Path, quota: int) -> Path:
    """Two tenants, each allowed ``quota`` requests now (then one per 1000 s), quotas shared."""
    path = where / "reward.yaml"
    path.write_text(yaml.safe_dump(server_config(quota)))
    return path


def server_config(quota: int) -> dict[str, Any]:
    tenant = {"requests_per_s": 0.001, "burst": quota, "concurrency": 2 * quota, "stores": ["127.0.0.1:*"]}
    return {
        "fleet": {"cluster": "shared"}, "max_concurrency": 4 * quota, "admin": {"token": ADMIN},
        "quota_store": "nats",
        "endpoints": {"team-a/digits": "charset:allowed=0123456789", "team-b/short": "concise:max_words=3"},
        "tenants": [{"name": "team-a", "token": TOKEN_A, "endpoints": ["team-a/digits"], **tenant},
                    {"name": "team-b", "token": TOKEN_B, "endpoints": ["team-b/short"], **tenant}],
    }  # fmt: skip


@pytest.fixture
def deploy_nats(monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddedNats]:
    """deploy/nats-server.conf without its TLS block, JetStream on (as the conf asks)."""
    text = re.sub(r"^tls \{.*?^\}\n", "", CONF.read_text(), flags=re.S | re.M)
    assert "tls {" not in text and "jetstream {" in text
    for user in USERS:  # the server reads them once, when it starts
        monkeypatch.setenv(f"RLFLEET_NATS_PASS_{user.upper().replace('-', '_')}", password(user))
    with EmbeddedNats(config=text) as server:
        yield server


@pytest.fixture
async def users(deploy_nats: EmbeddedNats) -> AsyncIterator[dict[str, NatsTransport]]:
    clients = {}
    for user in ("admin", "team-a", "team-b"):
        auth = NatsConnection(user=user, password=password(user))
        clients[user] = await NatsTransport.connect(deploy_nats.url, name=user, auth=auth, env={})
    yield clients
    for client in clients.values():
        await client.close()


async def score(client: NatsTransport, endpoint: str, token: str, ref: Any) -> ScoreResult | RemoteError:
    request = ScoreRequest(job_id=f"j-{uuid.uuid4().hex[:8]}", endpoint=endpoint, rollout=ref)  # each its own
    try:
        reply = await client.request(SCORE, request, timeout=30, tier="reward", headers={TOKEN_HEADER: token})
    except RemoteError as refused:
        return refused
    assert isinstance(reply, ScoreResult), reply
    return reply


async def replica_stats(admin: NatsTransport) -> list[RewardStats]:
    out = []
    for worker_id in REPLICAS:
        stats = await admin.request(worker_subject("shared", "reward", worker_id), RewardStatsRequest(),
                                    timeout=30, tier="reward", headers={TOKEN_HEADER: ADMIN})  # fmt: skip
        assert isinstance(stats, RewardStats)
        out.append(stats)
    return out


@pytest.mark.timeout(240)
async def test_a_tenant_gets_its_quota_once_across_two_replicas(
    deploy_nats: EmbeddedNats, users: dict[str, NatsTransport], spawn, rollout_store, tmp_path: Path
) -> None:
    from rlfleet.common.control.membership import WorkerRegistry

    login = {"RLFLEET_NATS_USER": "reward-server", "RLFLEET_NATS_PASSWORD": password("reward-server")}
    config = write_config(tmp_path, quota=10)
    for worker_id in REPLICAS:
        spawn.serve(worker_id, config, "--nats", deploy_nats.url, "--worker-id", worker_id, env=env(login))
    registry = WorkerRegistry(users["admin"], "shared")
    await registry.start()
    try:
        await registry.wait_for("reward", 2, timeout=180)
    finally:
        await registry.stop()
    ref = rollout_store.put(["2+2?"], ["4"], [0])

    burst = [score(users["team-a"], "team-a/digits", TOKEN_A, ref) for _ in range(20)]
    replies = await asyncio.gather(*burst)
    scored = [r for r in replies if isinstance(r, ScoreResult)]
    refused = [r for r in replies if isinstance(r, RemoteError)]
    assert len(scored) == 10 and len(refused) == 10, [str(r) for r in refused]
    for error in refused:
        assert error.code == "quota_exceeded" and error.retryable, error
        assert re.search(r"quota of 0.001 requests/s; retry in \d+\.\d\ds", str(error)), error
    stats = await replica_stats(users["admin"])
    served = [s.endpoints["team-a/digits"].requests for s in stats]
    over = [s.refused.get("team-a/quota_exceeded", 0) for s in stats]
    assert sum(served) == 10 and sum(over) == 10
    assert all(n + m > 0 for n, m in zip(served, over, strict=True)), "the queue group used both replicas"

    others = await asyncio.gather(*(score(users["team-b"], "team-b/short", TOKEN_B, ref) for _ in range(5)))
    assert all(isinstance(r, ScoreResult) for r in others), "team-a's count is not team-b's"

    reset = b'{"tokens": 10.0, "at": 0.0}'  # a tenant's try at refilling its own bucket: not permitted
    await users["team-a"].client.publish(f"$KV.{quota_bucket('shared')}.{quota_key('team-a')}", reset)
    await users["team-a"].flush()
    again = await score(users["team-a"], "team-a/digits", TOKEN_A, ref)
    assert isinstance(again, RemoteError) and again.code == "quota_exceeded"
    assert all(p.poll() is None for p in spawn.procs.values()), "both replicas go on"


@pytest.mark.timeout(120)
def test_a_replica_refuses_to_start_on_a_nats_server_without_jetstream(spawn, tmp_path: Path) -> None:
    with EmbeddedNats(jetstream=False) as plain:
        proc = spawn.serve("reward-r0", write_config(tmp_path, quota=10), "--nats", plain.url, env=env({}))
        assert proc.wait(timeout=100) == 2
    log = spawn.log("reward-r0")
    assert "QuotaStoreMissing" in log and "the NATS server has no JetStream" in log, log[-2000:]
    assert "quota_store: process" in log
