"""deploy/nats-server.conf on a real nats-server, with mutual TLS from certificates made here.

Each user of the shipped config (tiers, tenants, admin) publishes only what it is for: a tenant
scores but cannot shut the reward server down, join its queue group, read another tenant's replies
or reach the training cluster; a rollout worker cannot drive the trainer; a client without a
certificate or without a password cannot connect.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import Ack, AnyMessage, Message, ScoreRequest, Shutdown
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject, worker_subject
from rlfleet.common.errors import NatsServerError, NoResponders, RequestTimeout
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.common.schema.refs import TensorRef

pytestmark = pytest.mark.timeout(60)

CONF = Path(__file__).resolve().parents[2] / "deploy" / "nats-server.conf"
USERS = ("controller", "trainer", "rollout", "reward", "reward-server", "admin", "team-a", "team-b")


def _password(user: str) -> str:
    return f"pw-{user}-0123456789"


Issuer = tuple[x509.Name, ec.EllipticCurvePrivateKey]


def _cert(
    path: Path, name: str, key: ec.EllipticCurvePrivateKey, issuer: Issuer | None, *, ca: bool = False
) -> x509.Name:
    subject_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, signer = issuer if issuer is not None else (subject_name, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder().subject_name(subject_name).issuer_name(issuer_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )  # fmt: skip
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    path.write_bytes(builder.sign(signer, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return subject_name


def _key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))  # fmt: skip
    return key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("certs")
    ca_key = _key(where / "ca.key")
    ca = _cert(where / "ca.pem", "rlfleet test CA", ca_key, None, ca=True)
    for name in ("server", "client"):
        _cert(where / f"{name}.pem", name, _key(where / f"{name}.key"), (ca, ca_key))
    return where


@pytest.fixture(scope="module")
def server(certs: Path) -> Iterator[EmbeddedNats]:
    env = {f"RLFLEET_NATS_PASS_{u.upper().replace('-', '_')}": _password(u) for u in USERS}
    env |= {
        "RLFLEET_NATS_TLS_SERVER_CERT": str(certs / "server.pem"),
        "RLFLEET_NATS_TLS_SERVER_KEY": str(certs / "server.key"),
        "RLFLEET_NATS_TLS_CA": str(certs / "ca.pem"),
    }
    with pytest.MonkeyPatch.context() as patch:  # the server reads them once, when it starts
        for name, value in env.items():
            patch.setenv(name, value)
        nats = EmbeddedNats(jetstream=False, config=CONF.read_text()).start()
    try:
        yield nats
    finally:
        nats.stop()


def _auth(certs: Path, user: str | None, *, cert: bool = True) -> NatsConnection:
    mine = (
        {"tls_cert_file": str(certs / "client.pem"), "tls_key_file": str(certs / "client.key")}
        if cert
        else {}
    )
    login = {"user": user, "password": _password(user)} if user else {}
    return NatsConnection(tls_ca_file=str(certs / "ca.pem"), **mine, **login)


@pytest.fixture
async def users(server: EmbeddedNats, certs: Path) -> AsyncIterator[dict[str, NatsTransport]]:
    clients = {u: await NatsTransport.connect(server.url, name=u, auth=_auth(certs, u)) for u in USERS}
    yield clients
    for client in clients.values():
        await client.close()


class Inbox:
    def __init__(self) -> None:
        self.got: list[AnyMessage] = []

    async def __call__(self, message: AnyMessage) -> Message | None:
        self.got.append(message)
        return Ack(detail="done")


async def _settle(*clients: NatsTransport) -> None:
    for client in clients:
        await client.flush()
    await asyncio.sleep(0.2)


def _score() -> ScoreRequest:
    return ScoreRequest(
        job_id="j", endpoint="team-a/digits", rollout=TensorRef(address="127.0.0.1:1", key="k")
    )


@pytest.mark.parametrize("how", ["no certificate", "no password"])
async def test_strangers_cannot_connect(server: EmbeddedNats, certs: Path, how: str) -> None:
    auth = _auth(certs, "team-a", cert=False) if how == "no certificate" else _auth(certs, None)
    with pytest.raises(NatsServerError):
        await NatsTransport.connect(server.url, name="stranger", auth=auth, connect_timeout=3.0,
                                    max_reconnect_attempts=0)  # fmt: skip


async def test_a_tenant_scores_and_nothing_more(users: dict[str, NatsTransport]) -> None:
    replica, replica_own = Inbox(), Inbox()
    await users["reward-server"].subscribe(subject("shared", "reward", "score"), replica, queue="reward")
    await users["reward-server"].subscribe(worker_subject("shared", "reward", "r0"), replica_own)
    reply = await users["team-a"].request(subject("shared", "reward", "score"), _score(), timeout=5)
    assert isinstance(reply, Ack) and len(replica.got) == 1

    team_a = users["team-a"]
    thief, sniffed = Inbox(), Inbox()
    await team_a.subscribe(subject("shared", "reward", "score"), thief, queue="reward")  # refused
    await team_a.subscribe("_INBOX.team-b.>", sniffed)  # refused
    await team_a.publish(worker_subject("shared", "reward", "r0"), Shutdown(reason="tenant"))
    await team_a.publish(subject("prod", "trainer", "step"), Shutdown(reason="tenant"))
    await _settle(team_a)
    for _ in range(4):
        await users["team-b"].request(subject("shared", "reward", "score"), _score(), timeout=5)
    await _settle(users["team-b"])
    assert replica_own.got == [] and thief.got == [] and sniffed.got == []
    assert len(replica.got) == 5

    done = await users["admin"].request(worker_subject("shared", "reward", "r0"), Shutdown(), timeout=5)
    assert isinstance(done, Ack) and len(replica_own.got) == 1


async def test_the_tiers_of_the_training_cluster_keep_to_their_roles(users: dict[str, NatsTransport]) -> None:
    step = Inbox()
    await users["trainer"].subscribe(subject("prod", "trainer", "step"), step, queue="trainer")
    await users["rollout"].publish(subject("prod", "trainer", "step"), Shutdown(reason="forged"))
    await users["reward"].publish(subject("prod", "trainer", "step"), Shutdown(reason="forged"))
    await _settle(users["rollout"], users["reward"])
    assert step.got == []
    reply = await users["controller"].request(subject("prod", "trainer", "step"), Shutdown(), timeout=5)
    assert isinstance(reply, Ack) and len(step.got) == 1
    with pytest.raises((NoResponders, RequestTimeout)):  # the tenant never reaches the cluster's trainer
        await users["team-a"].request(subject("prod", "trainer", "step"), Shutdown(), timeout=1.0)
