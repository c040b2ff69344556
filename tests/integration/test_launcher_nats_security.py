"""The launcher's benchmark-only NATS switch (``RLFLEET_BENCHMARK_NATS``), on a real nats-server.

By default an embedded fleet's server takes only its per-role credentials, whatever else the
environment holds; ``open`` starts a server any client may use (what
``benchmarks/security_overhead.py`` compares against); ``tls:CERT,KEY`` keeps the credentials and
refuses plain TCP. Anything else is a config error naming the variable, not a silent default.
"""

from __future__ import annotations

import datetime
import ipaddress
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.errors import ConfigError, NatsServerError
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.controller.launcher import BENCHMARK_NATS_ENV, EmbeddedFleet, NatsSecurity, WorkerSpec

pytestmark = pytest.mark.timeout(60)


def _self_signed(folder: Path) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "embedded-nats")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = folder / "nats.pem", folder / "nats.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return str(cert_file), str(key_file)


async def _connects(url: str, auth: NatsConnection) -> bool:
    try:
        client = await NatsTransport.connect(url, name="test-client", auth=auth, env={}, connect_timeout=3)
    except NatsServerError:
        return False
    await client.close()
    return True


def test_the_switch_reads_only_its_values() -> None:
    assert NatsSecurity.from_env({}) == NatsSecurity()
    assert NatsSecurity.from_env({BENCHMARK_NATS_ENV: "open"}) == NatsSecurity(open=True)
    assert NatsSecurity.from_env({BENCHMARK_NATS_ENV: "tls:a.pem,a.key"}) == NatsSecurity(
        tls_cert="a.pem", tls_key="a.key"
    )
    for bad in ("off", "1", "false", "tls:a.pem", "tls:,a.key", "openx"):
        with pytest.raises(ConfigError, match=BENCHMARK_NATS_ENV):
            NatsSecurity.from_env({BENCHMARK_NATS_ENV: bad})


async def test_by_default_strangers_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BENCHMARK_NATS_ENV, raising=False)
    monkeypatch.setenv("RLFLEET_NATS_TOKEN", "from-the-shell")  # no other variable loosens it
    with EmbeddedFleet(tmp_path) as fleet:
        url = fleet.start_nats("sec")
        assert fleet.processes.security == NatsSecurity() and fleet.processes.credentials is not None
        assert not await _connects(url, NatsConnection())
        assert await _connects(url, fleet.connection("controller"))


async def test_open_takes_any_client_and_gives_workers_no_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BENCHMARK_NATS_ENV, "open")
    with EmbeddedFleet(tmp_path) as fleet:
        url = fleet.start_nats("sec")
        assert fleet.processes.credentials is None
        assert await _connects(url, NatsConnection())
        script = "import os; print('NATS', sorted(k for k in os.environ if k.startswith('RLFLEET_NATS_')))"
        worker = fleet.spawn(WorkerSpec("rollout", "rollout-0", {}, command=[sys.executable, "-c", script]))
        worker.process.wait(timeout=20)
        assert "NATS []" in worker.log_path.read_text()


async def test_tls_keeps_the_credentials_and_refuses_plain_tcp(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    with EmbeddedFleet(tmp_path / "run", security=NatsSecurity(tls_cert=cert, tls_key=key)) as fleet:
        url = fleet.start_nats("sec")
        login = fleet.connection("controller")
        assert login.tls_ca_file == cert and login.user == "controller"
        assert await _connects(url, login)
        assert not await _connects(url, login.model_copy(update={"tls_ca_file": ""}))  # plain TCP
        assert not await _connects(url, NatsConnection(tls_ca_file=cert))  # TLS, no credentials
        script = "import os; print('CA', os.environ.get('RLFLEET_NATS_TLS_CA_FILE'))"
        worker = fleet.spawn(WorkerSpec("reward", "reward-0", {}, command=[sys.executable, "-c", script]))
        worker.process.wait(timeout=20)
        assert f"CA {cert}" in worker.log_path.read_text()
