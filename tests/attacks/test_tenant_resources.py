"""A tenant of a shared reward server against the server's resources (issue 29, points 5 and 6).

On the reward tests' setup (a :class:`RewardWorker` on an in-process transport, real TensorStores
over gRPC; the ping flood on a real nats-server run with ``deploy/nats-server.conf`` and a real
``rlfleet-reward serve`` process), a tenant tries to make the server:

- fetch texts of any size from the tenant's own store: over ``sample_bytes`` / ``request_bytes``
  the request is refused before the texts are read (the store records every Get); a store that
  declares less than it sends is cut off; a tenant's requests together hold at most
  ``bytes_in_flight``;
- keep computing after the requester gave up: past the request's ``deadline`` (or the tenant's
  ``request_s``) scoring stops within one slice of samples and nothing runs on;
- broadcast: a flood of pings makes each worker announce at a bounded rate;
- connect to a store its ``stores`` do not allow, through a name shaped like an allowed address,
  or through a name whose DNS answer changes after the check (the address checked is dialled);
- tell whether a path exists on the server: every model path outside its ``model_dirs`` is refused
  with one message, existing or not.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import PING_ANSWER_INTERVAL_S
from rlfleet.common.control.messages import Ping, ScoreRequest, SetRewardSpec, WorkerAnnounce
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import TOKEN_HEADER, membership_subject, ping_subject, subject
from rlfleet.common.errors import RemoteError, RequestTimeout
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors.store import TensorStoreServer
from rlfleet.reward.service import SCORE_SLICE

pytestmark = pytest.mark.timeout(90)

SCORE = subject("test", "reward", "score")
OWN = subject("test", "reward", "worker.reward-0")
TOKEN_A, TOKEN_B, ADMIN = "token-of-team-a", "token-of-team-b", "the-admin-token"
DIGITS = "charset:allowed=0123456789"


class TenantsOwnStore(TensorStoreServer):
    """A tenant's own TensorStore: a real one, which records the tensors each Get asks for and, when
    ``lie`` is set, declares (``Stat``) far fewer bytes than it then sends, as a hostile store may."""

    def __init__(self) -> None:
        super().__init__()
        self.gets: list[list[str]] = []
        self.lie = False

    async def _get(self, request: Any, context: Any) -> AsyncIterator[bytes]:
        self.gets.append(sorted(request.names))
        async for chunk in super()._get(request, context):
            yield chunk

    async def _stat(self, request: Any, context: Any) -> Any:
        reply = await super()._stat(request, context)
        if self.lie:
            for info in reply.tensors:
                info.nbytes = min(info.nbytes, 16)
        return reply

    def put(self, prompts: Sequence[str], responses: Sequence[str]) -> TensorRef:
        from rlfleet.common.schema.batch import RolloutBatch

        n = len(responses)
        batch = RolloutBatch.from_rows(
            prompts=[[1, 2]] * n, responses=[[3]] * n, logprobs=[[0.0]] * n, group_index=list(range(n)),
            pad_id=0, prompt_text=list(prompts), response_text=list(responses),
        )  # fmt: skip
        return self.put_local(f"batch-{uuid.uuid4().hex[:8]}", batch.to_tensors())


@pytest.fixture
async def own_store() -> AsyncIterator[TenantsOwnStore]:
    store = TenantsOwnStore()
    await store.start()
    yield store
    await store.stop()


def tenant(name: str, token: str, endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "token": token, "endpoints": [endpoint], "stores": ["127.0.0.1:*"], **extra}


def shared(*tenants: dict[str, Any], **server: Any) -> dict[str, Any]:
    endpoints = {"a/digits": DIGITS, "b/digits": DIGITS}
    return {"endpoints": endpoints, "tenants": list(tenants), "admin": {"token": ADMIN}, **server}


async def ask(client, target: str, message, token: str, timeout: float = 10):
    return await client.request(target, message, timeout=timeout, headers={TOKEN_HEADER: token})


async def refused(client, target: str, message, token: str, code: str, timeout: float = 10) -> str:
    with pytest.raises(RemoteError) as info:
        await ask(client, target, message, token, timeout)
    assert info.value.code == code, info.value
    return str(info.value)


def score(ref: TensorRef, endpoint: str = "a/digits", **fields: Any) -> ScoreRequest:
    return ScoreRequest(job_id=f"j-{uuid.uuid4().hex[:8]}", endpoint=endpoint, rollout=ref, **fields)


# --- bytes ----------------------------------------------------------------------------------


async def test_texts_over_the_tenants_caps_are_refused_before_they_are_fetched(
    reward_server, own_store: TenantsOwnStore
) -> None:
    client, _ = await reward_server(shared(tenant("team-a", TOKEN_A, "a/digits")))  # default limits
    long_sample = own_store.put(["p"], ["1" * (2 << 20)])  # one sample of 2 MB: over sample_bytes (1 MiB)
    text = await refused(client, SCORE, score(long_sample), TOKEN_A, "batch_too_large")
    assert "one sample holds 2097153 bytes, over its sample_bytes of 1048576" in text
    assert own_store.gets and all(
        not {"prompt_text", "response_text"} & set(names) for names in own_store.gets
    )

    own_store.gets.clear()
    limits = {"sample_bytes": 1000, "request_bytes": 100_000, "bytes_in_flight": 200_000}
    client, _ = await reward_server(shared(tenant("team-a", TOKEN_A, "a/digits", limits=limits)))
    many = own_store.put(["p"] * 200, ["1" * 800] * 200)  # 200 samples under the sample cap, 160 kB in all
    text = await refused(client, SCORE, score(many), TOKEN_A, "batch_too_large")
    assert re.search(r"the request's texts take \d+ bytes, over its request_bytes of 100000", text), text
    assert own_store.gets == [], "nothing is read from the store before the sizes are checked"

    fine = own_store.put(["p"] * 3, ["1", "22", "333"])
    assert (await ask(client, SCORE, score(fine), TOKEN_A)).scores == [1.0, 1.0, 1.0]


async def test_a_store_that_sends_more_than_it_declared_is_cut_off(
    reward_server, own_store: TenantsOwnStore
) -> None:
    client, _ = await reward_server(shared(tenant("team-a", TOKEN_A, "a/digits")))
    own_store.lie = True  # declares 16 bytes a tensor, sends 2 MB of response text
    ref = own_store.put(["p"] * 4, ["1" * (512 << 10)] * 4)
    text = await refused(client, SCORE, score(ref), TOKEN_A, "batch_too_large")
    assert "where it declared" in text and "cut off" in text


async def test_a_tenants_requests_hold_at_most_its_bytes_in_flight(
    reward_server, own_store: TenantsOwnStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = slow_module(tmp_path, monkeypatch, per_sample_s=0.0)
    limits = {"bytes_in_flight": 150_000, "request_bytes": 100_000}
    cfg = shared(tenant("team-a", TOKEN_A, "a/digits", limits=limits, concurrency=4),
                 tenant("team-b", TOKEN_B, "b/digits"), max_concurrency=8)  # fmt: skip
    cfg["endpoints"]["a/digits"] = f"{module.__name__}:score"  # the operator's function: it waits
    client, worker = await reward_server(cfg)
    ref = own_store.put(["p"] * 100, ["1" * 800] * 100)  # about 81 kB: one fits, two do not
    first = asyncio.create_task(ask(client, SCORE, score(ref), TOKEN_A, timeout=30))
    try:
        await wait_until(lambda: module.calls > 0)
        text = await refused(client, SCORE, score(ref), TOKEN_A, "quota_exceeded", timeout=5)
        assert "more than 150000 bytes of texts at once (its bytes_in_flight)" in text
        assert (await ask(client, SCORE, score(ref, "b/digits"), TOKEN_B)).scores == [1.0] * 100
    finally:
        module.release.set()
    assert len((await first).scores) == 100
    assert (await ask(client, SCORE, score(ref), TOKEN_A)).scores == [1.0] * 100, "its bytes were given back"


# --- deadlines ------------------------------------------------------------------------------


def slow_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_sample_s: float) -> Any:
    """An operator's reward function that counts its calls, sleeps ``per_sample_s`` each, and
    (with ``per_sample_s`` 0) waits for ``release``."""
    import importlib

    name = f"slow_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""
        import threading, time
        calls = 0
        release = threading.Event()
        def score(prompt, response, **metadata):
            global calls
            calls += 1
            if {per_sample_s!r}:
                time.sleep({per_sample_s!r})
            else:
                release.wait(30)
            return 1.0
    """))  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


async def wait_until(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.02)


async def test_scoring_stops_when_the_requests_deadline_passes(
    reward_server, own_store: TenantsOwnStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = slow_module(tmp_path, monkeypatch, per_sample_s=0.05)  # 200 samples: 10 s of work
    cfg = shared(tenant("team-a", TOKEN_A, "a/digits"))
    cfg["endpoints"]["a/digits"] = f"{module.__name__}:score"
    client, worker = await reward_server(cfg)
    ref = own_store.put(["p"] * 200, ["1"] * 200)

    late = score(ref, deadline=time.time() - 1)  # already past when it arrives: no work at all
    text = await refused(client, SCORE, late, TOKEN_A, "timeout")
    assert "deadline passed" in text and module.calls == 0

    with pytest.raises((RemoteError, RequestTimeout)):  # the requester waits 1 s, as its deadline says
        await ask(client, SCORE, score(ref, deadline=time.time() + 1.0), TOKEN_A, timeout=1.0)
    await wait_until(lambda: worker.busy == 0, timeout=5)
    done = module.calls
    await asyncio.sleep(1.0)
    assert module.calls == done, "nothing runs on after the deadline"
    assert done < 200 and done <= 1.0 / 0.05 + SCORE_SLICE + 5, done  # one slice past the deadline at most


async def test_a_tenants_request_stops_at_its_request_s_without_a_deadline(
    reward_server, own_store: TenantsOwnStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = slow_module(tmp_path, monkeypatch, per_sample_s=0.05)
    cfg = shared(tenant("team-a", TOKEN_A, "a/digits", limits={"request_s": 1.0}))
    cfg["endpoints"]["a/digits"] = f"{module.__name__}:score"
    client, worker = await reward_server(cfg)
    ref = own_store.put(["p"] * 200, ["1"] * 200)
    text = await refused(client, SCORE, score(ref), TOKEN_A, "timeout", timeout=8)
    assert "deadline passed" in text and worker.busy == 0
    assert module.calls < 200


# --- amplification --------------------------------------------------------------------------

CONF = Path(__file__).resolve().parents[2] / "deploy" / "nats-server.conf"
USERS = ("controller", "trainer", "rollout", "reward", "reward-server", "admin", "team-a", "team-b")


def password(user: str) -> str:
    return f"pw-{user}-0123456789"


@pytest.fixture
def deploy_nats(monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddedNats]:
    """deploy/nats-server.conf without its TLS block (tests/reward/test_shared_quotas.py does the same)."""
    text = re.sub(r"^tls \{.*?^\}\n", "", CONF.read_text(), flags=re.S | re.M)
    assert "tls {" not in text
    for user in USERS:
        monkeypatch.setenv(f"RLFLEET_NATS_PASS_{user.upper().replace('-', '_')}", password(user))
    with EmbeddedNats(config=text) as server:
        yield server


@pytest.mark.timeout(180)
async def test_a_ping_flood_makes_a_worker_announce_at_a_bounded_rate(
    deploy_nats: EmbeddedNats, spawn, tmp_path: Path
) -> None:
    config = {
        "fleet": {"cluster": "shared"}, "worker_id": "reward-r0", "quota_store": "process",
        "admin": {"token": ADMIN}, "endpoints": {"team-a/digits": DIGITS},
        "tenants": [tenant("team-a", TOKEN_A, "team-a/digits")],
    }  # fmt: skip
    (tmp_path / "reward.yaml").write_text(yaml.safe_dump(config))
    login = {"RLFLEET_NATS_USER": "reward-server", "RLFLEET_NATS_PASSWORD": password("reward-server")}
    spawn.serve("reward-r0", tmp_path / "reward.yaml", "--nats", deploy_nats.url,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **login})  # fmt: skip
    auth = NatsConnection(user="team-a", password=password("team-a"))
    team_a = await NatsTransport.connect(deploy_nats.url, name="team-a", auth=auth, env={})
    announces: list[float] = []

    async def seen(message: Any) -> None:
        if isinstance(message, WorkerAnnounce) and message.worker_id == "reward-r0":
            announces.append(time.monotonic())

    try:
        await team_a.subscribe(membership_subject("shared", "reward"), seen)
        end = time.monotonic() + 120
        while not announces:  # the server is up once it answers a ping (its first announce may be missed)
            assert time.monotonic() < end and spawn.procs["reward-r0"].poll() is None, spawn.log("reward-r0")
            await team_a.publish(ping_subject("shared"), Ping())
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)
        announces.clear()
        start, sent = time.monotonic(), 0
        while time.monotonic() - start < 2.0:  # the tenant pings as fast as it can for 2 s
            for _ in range(50):
                await team_a.publish(ping_subject("shared"), Ping())
            sent += 50
            await team_a.flush()
        await asyncio.sleep(1.5)
        window = time.monotonic() - start
    finally:
        await team_a.close()
    # Thousands of pings; at most one announce per PING_ANSWER_INTERVAL_S, and still answered.
    gaps = [b - a for a, b in zip(announces, announces[1:], strict=False)]
    most = window / PING_ANSWER_INTERVAL_S + 1
    assert sent >= 1000 and 1 <= len(announces) <= most, (sent, len(announces), window)
    assert min(gaps, default=1.0) >= 0.9 * PING_ANSWER_INTERVAL_S, gaps


# --- stores ---------------------------------------------------------------------------------


async def test_a_name_shaped_like_an_allowed_address_does_not_pass(reward_server, own_store) -> None:
    ref = own_store.put(["p"], ["1"])
    port = ref.address.rpartition(":")[2]
    client, _ = await reward_server(
        shared(tenant("team-a", TOKEN_A, "a/digits", stores=["10.20.*:*", "127.*:*"]))
    )
    for host in ("10.20.0.1.evil.invalid", "127.0.0.1.attacker.invalid"):
        forged = ref.model_copy(update={"address": f"{host}:{port}"})
        text = await refused(client, SCORE, score(forged), TOKEN_A, "forbidden")
        assert f"may not fetch rollouts from '{host}:{port}'" in text
    assert (await ask(client, SCORE, score(ref), TOKEN_A)).scores == [1.0]


async def test_a_store_name_is_resolved_once_and_the_checked_address_is_dialled(
    reward_server, own_store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DNS answer is the one part not run here: ``socket.getaddrinfo`` answers for one name."""
    ref = own_store.put(["p"], ["1"])
    port = int(ref.address.rpartition(":")[2])
    answer = {"ip": "127.0.0.1"}
    real = socket.getaddrinfo

    def resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "rollouts.team-a.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answer["ip"], port))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    client, _ = await reward_server(shared(tenant("team-a", TOKEN_A, "a/digits", stores=["127.0.0.1:*"])))
    named = ref.model_copy(update={"address": f"rollouts.team-a.test:{port}"})
    # gRPC cannot resolve the name itself (.test): it is scored only because 127.0.0.1 was dialled.
    assert (await ask(client, SCORE, score(named), TOKEN_A)).scores == [1.0]
    answer["ip"] = "10.99.0.1"  # the name now points elsewhere: checked again, refused
    text = await refused(client, SCORE, score(named), TOKEN_A, "forbidden")
    assert "may not fetch rollouts from 'rollouts.team-a.test:" in text


# --- paths ----------------------------------------------------------------------------------


async def test_every_model_path_a_tenant_may_not_use_gets_one_message(reward_server, tmp_path: Path) -> None:
    allowed, outside = tmp_path / "team-a-models", tmp_path / "elsewhere"
    allowed.mkdir()
    (outside / "a-model").mkdir(parents=True)
    (outside / "a-model" / "config.json").write_text("{}")
    (allowed / "link-out").symlink_to(outside / "a-model")
    may_update = shared(tenant("team-a", TOKEN_A, "a/digits", can_update=True))
    client, _ = await reward_server(may_update)  # no model_dirs: no path is the tenant's
    probes = [
        outside / "a-model",
        outside,
        outside / "missing",
        Path("/etc"),
        Path("/no/such"),
        "relative/model",
    ]
    await one_message(client, probes)

    may_update["tenants"][0]["model_dirs"] = [str(allowed)]
    client, _ = await reward_server(may_update)
    await one_message(client, [outside / "a-model", outside / "missing", allowed / "link-out",
                               allowed / ".." / "elsewhere" / "a-model"])  # fmt: skip
    inside = await refused(client, OWN, SetRewardSpec(endpoint="a/digits", spec=f"rm:path={allowed / 'x'}"),
                           TOKEN_A, "bad_request")  # fmt: skip
    assert "no such directory" in inside, "under its model_dirs, the tenant gets the loader's own answer"


async def one_message(client, paths: Sequence[Path | str]) -> None:
    """Every way of naming each of ``paths`` is refused with the same text, which names none of them."""
    messages = set()
    for path in paths:
        for message in (SetRewardSpec(endpoint="a/digits", spec=f"rm:path={path}"),
                        SetRewardSpec(endpoint="a/digits", spec=f"similarity:model={path}"),
                        SetRewardSpec(endpoint="a/digits", model_path=str(path))):  # fmt: skip
            with pytest.raises(RemoteError) as info:
                await ask(client, OWN, message, TOKEN_A)
            messages.add((info.value.code, str(info.value)))
    assert len(messages) == 1, sorted(messages)
    code, text = messages.pop()
    assert code == "forbidden" and not any(str(p) in text for p in paths), text
