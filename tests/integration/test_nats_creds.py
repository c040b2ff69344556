"""NKey seed and ``.creds`` (JWT) logins of :class:`NatsConnection`, against a real nats-server.

The keys, and the operator, account and user JWTs of a decentralized-auth server, are made here
with ``nkeys`` (what ``nsc`` would make): a user logs in with its seed file, or with its ``.creds``
file (user JWT plus seed, nats-py signs the server's nonce), from the config or from
``RLFLEET_NATS_*``; a stranger's seed or a user signed by an account the operator never issued is
refused; the subject permissions written in the user JWT are what the server enforces.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import nkeys
import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import Ack, AnyMessage, Message, Ping
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.errors import NatsServerError
from rlfleet.common.schema.connection import NatsConnection

pytestmark = pytest.mark.timeout(60)

UNLIMITED = {"subs": -1, "data": -1, "payload": -1}


def keypair(prefix: int) -> nkeys.KeyPair:
    """A fresh NKey of one role (``nkeys.PREFIX_BYTE_OPERATOR``, ``_ACCOUNT``, ``_USER``)."""
    return nkeys.from_seed(nkeys.encode_seed(secrets.token_bytes(32), prefix))


def public(key: nkeys.KeyPair) -> str:
    return key.public_key.decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def issue_jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats_claims: dict[str, object]) -> str:
    """A NATS v2 JWT for ``subject``, signed by ``issuer`` (ed25519 over ``header.claims``)."""
    claims: dict[str, object] = {"jti": "", "iat": int(time.time()), "iss": public(issuer), "name": name,
                                 "sub": subject, "nats": {**nats_claims, "version": 2}}  # fmt: skip
    digest = hashlib.sha512(json.dumps(claims).encode()).digest()[:32]
    claims["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{header}.{body}.{_b64(issuer.sign(f'{header}.{body}'.encode()))}"


def creds_file(path: Path, user_jwt: str, seed: bytes) -> Path:
    """A ``.creds`` file in the layout ``nsc`` writes."""
    path.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n"
    )
    path.chmod(0o600)
    return path


def user_jwt(account: nkeys.KeyPair, user: nkeys.KeyPair, deny_publish: list[str]) -> str:
    return issue_jwt(account, public(user), "trainer-a",
                     {"type": "user", "pub": {"deny": deny_publish}, "sub": {}, **UNLIMITED})  # fmt: skip


class Echo:
    async def __call__(self, message: AnyMessage) -> Message | None:
        return Ack(detail=f"echo {message.kind}")


async def _logs_in(url: str, auth: NatsConnection | None, env: dict[str, str]) -> None:
    """A client with ``auth`` (or only ``env``) connects, and a request to its own echo handler comes back."""
    transport = await NatsTransport.connect(url, name="login", auth=auth, env=env)
    try:
        await transport.subscribe("rlfleet.t.trainer.echo", Echo())
        reply = await transport.request("rlfleet.t.trainer.echo", Ping(), timeout=5)
        assert isinstance(reply, Ack) and reply.detail == "echo worker.ping"
    finally:
        await transport.close()


async def _refused(url: str, auth: NatsConnection) -> NatsServerError:
    with pytest.raises(NatsServerError, match="refused these credentials") as caught:
        await NatsTransport.connect(url, name="stranger", auth=auth, env={}, connect_timeout=3.0,
                                    max_reconnect_attempts=0)  # fmt: skip
    return caught.value


# --- an NKey user -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nkey_user(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, Path]]:
    user = keypair(nkeys.PREFIX_BYTE_USER)
    seed = tmp_path_factory.mktemp("nkey") / "user.nk"
    seed.write_bytes(user.seed + b"\n")
    seed.chmod(0o600)
    config = "authorization: " + json.dumps({"users": [{"nkey": public(user)}]}) + "\n"
    with EmbeddedNats(jetstream=False, config=config) as server:
        yield server, seed


async def test_an_nkey_seed_logs_in(nkey_user: tuple[EmbeddedNats, Path]) -> None:
    server, seed = nkey_user
    await _logs_in(server.url, NatsConnection(nkey_seed_file=str(seed)), {})
    await _logs_in(server.url, None, {"RLFLEET_NATS_NKEY_SEED_FILE": str(seed)})  # from the environment


async def test_a_stranger_seed_or_none_is_refused(
    nkey_user: tuple[EmbeddedNats, Path], tmp_path: Path
) -> None:
    server, _ = nkey_user
    other = tmp_path / "other.nk"
    other.write_bytes(keypair(nkeys.PREFIX_BYTE_USER).seed)
    error = await _refused(server.url, NatsConnection(nkey_seed_file=str(other)))
    assert other.read_text() not in str(error)  # the seed never shows
    await _refused(server.url, NatsConnection())


# --- decentralized auth: operator, account and user JWTs, a .creds file ----------------------------


class Operator:
    """An operator and one account it issued, as a nats-server config with a memory resolver."""

    def __init__(self) -> None:
        self.key = keypair(nkeys.PREFIX_BYTE_OPERATOR)
        self.account = keypair(nkeys.PREFIX_BYTE_ACCOUNT)
        limits = {**UNLIMITED, "imports": -1, "exports": -1, "wildcards": True, "conn": -1, "leaf": -1}
        self.account_jwt = issue_jwt(
            self.key, public(self.account), "team-a", {"type": "account", "limits": limits}
        )

    def server_config(self) -> str:
        operator_jwt = issue_jwt(self.key, public(self.key), "rlfleet-test", {"type": "operator"})
        return (f"operator: {operator_jwt}\nresolver: MEMORY\n"
                f"resolver_preload: {{\n  {public(self.account)}: {self.account_jwt}\n}}\n")  # fmt: skip


@pytest.fixture(scope="module")
def operator_server() -> Iterator[tuple[EmbeddedNats, Operator]]:
    operator = Operator()
    with EmbeddedNats(jetstream=False, config=operator.server_config()) as server:
        yield server, operator


async def test_a_creds_file_logs_in_and_its_jwt_permissions_hold(
    operator_server: tuple[EmbeddedNats, Operator], tmp_path: Path
) -> None:
    server, operator = operator_server
    user = keypair(nkeys.PREFIX_BYTE_USER)
    creds = creds_file(tmp_path / "trainer.creds", user_jwt(operator.account, user, ["rlfleet.t.rollout.>"]),
                       user.seed)  # fmt: skip
    auth = NatsConnection(creds_file=str(creds))
    await _logs_in(server.url, auth, {})
    # the user JWT's own permissions are in force: a denied publish is a permissions violation
    errors: list[Exception] = []

    async def collect(exc: Exception) -> None:
        errors.append(exc)

    raw = await nats.connect(server.url, error_cb=collect, max_reconnect_attempts=0,
                             **auth.resolved({}).connect_options())  # fmt: skip
    try:
        await raw.publish("rlfleet.t.rollout.load_weights", b"{}")
        await raw.flush()
        await asyncio.sleep(0.3)
    finally:
        await raw.close()
    assert any("permissions violation" in str(e).lower() and "rollout.load_weights" in str(e) for e in errors)


async def test_creds_from_the_environment(
    operator_server: tuple[EmbeddedNats, Operator], tmp_path: Path
) -> None:
    server, operator = operator_server
    user = keypair(nkeys.PREFIX_BYTE_USER)
    creds = creds_file(tmp_path / "env.creds", user_jwt(operator.account, user, []), user.seed)
    await _logs_in(server.url, None, {"RLFLEET_NATS_CREDS_FILE": str(creds)})


async def test_forged_creds_are_refused(
    operator_server: tuple[EmbeddedNats, Operator], tmp_path: Path
) -> None:
    server, operator = operator_server
    user = keypair(nkeys.PREFIX_BYTE_USER)
    rogue = keypair(nkeys.PREFIX_BYTE_ACCOUNT)  # an account the operator never issued
    forged = creds_file(tmp_path / "rogue.creds", user_jwt(rogue, user, []), user.seed)
    await _refused(server.url, NatsConnection(creds_file=str(forged)))
    thief = keypair(nkeys.PREFIX_BYTE_USER)  # a real user's JWT with another key's seed
    stolen = creds_file(tmp_path / "stolen.creds", user_jwt(operator.account, user, []), thief.seed)
    await _refused(server.url, NatsConnection(creds_file=str(stolen)))
    await _refused(server.url, NatsConnection())
