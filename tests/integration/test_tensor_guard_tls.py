"""TLS and mutual TLS on the tensor plane: certificates from a CA made in the test, over real gRPC.

A store with a certificate serves TLS clients and refuses plain ones; a store that also has a
client CA (``tensor_tls_client_ca``) serves only clients presenting a certificate that CA signed:
one without a certificate, or with one from another CA, is refused, and the error says what to
check (gRPC itself reports a failed handshake only as a closed socket). A worker's
store and clients built from :class:`TensorPlaneSettings` (what every tier and the controller
use) speak mTLS to each other. Missing TLS files are named config errors.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from rlfleet.common.errors import ConfigError, TensorStoreUnavailable
from rlfleet.common.schema.worker import TensorPlaneSettings
from rlfleet.common.tensors.store import TensorStoreClient, TensorStoreServer, worker_client, worker_store


class CA:
    """A certificate authority in ``folder``: its own certificate, and the ones it issues."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder, self.key = folder, ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = self._sign(self.name, self.key.public_key(), ca=True)
        self.file = str(self._write(name, self.cert, self.key)[0])

    def _sign(
        self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey, *, ca: bool
    ) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        return (
            x509.CertificateBuilder().subject_name(subject).issuer_name(self.name).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )  # fmt: skip

    def _write(self, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
        cert_file, key_file = self.folder / f"{name}.pem", self.folder / f"{name}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))  # fmt: skip
        return cert_file, key_file

    def issue(self, name: str) -> tuple[str, str]:
        """A certificate for ``name`` (valid for localhost and 127.0.0.1) and its key, as PEM files."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert_file, key_file = self._write(name, self._sign(subject, key.public_key(), ca=False), key)
        return str(cert_file), str(key_file)


@pytest.mark.timeout(60)
async def test_tls_store_serves_tls_clients_only(tmp_path: Path) -> None:
    ca = CA(tmp_path, "run-ca")
    cert, key = ca.issue("store")
    srv = TensorStoreServer(tls_cert=cert, tls_key=key)
    await srv.start()
    try:
        assert srv.tls
        ref = srv.put_local("k", {"x": torch.arange(10)})
        async with TensorStoreClient(srv.address, tls_ca=ca.file) as secure:
            assert torch.equal((await secure.fetch(ref))["x"], torch.arange(10))
        async with TensorStoreClient(srv.address, timeout_s=3) as plain:
            with pytest.raises(TensorStoreUnavailable, match="refuses plain clients \\(set tensor_tls_ca\\)"):
                await plain.fetch(ref)
    finally:
        await srv.stop(grace=None)
    with pytest.raises(ConfigError, match="tensor_tls_key"):
        TensorStoreServer(tls_cert=cert)
    with pytest.raises(ConfigError, match="tensor_tls_cert"):
        TensorStoreServer(tls_client_ca=ca.file)  # a client CA alone: no certificate to serve with
    with pytest.raises(ConfigError, match="cannot read"):
        TensorStoreClient("127.0.0.1:1", tls_ca=str(tmp_path / "missing.pem"))


@pytest.mark.timeout(60)
async def test_mutual_tls_serves_only_clients_with_a_certificate_of_its_ca(tmp_path: Path) -> None:
    ca, stranger_ca = CA(tmp_path, "run-ca"), CA(tmp_path, "stranger-ca")
    cert, key = ca.issue("store")
    srv = TensorStoreServer(tls_cert=cert, tls_key=key, tls_client_ca=ca.file)
    await srv.start()
    try:
        ref = srv.put_local("rollout/job-1", {"x": torch.arange(10)})
        client_cert, client_key = ca.issue("trainer")
        async with TensorStoreClient(
            srv.address, tls_ca=ca.file, tls_cert=client_cert, tls_key=client_key
        ) as ok:
            assert torch.equal((await ok.fetch(ref))["x"], torch.arange(10))
        rogue_cert, rogue_key = stranger_ca.issue("intruder")
        refusals = (
            ("", "", "without a certificate of its own.*set tensor_tls_cert and tensor_tls_key"),
            (
                rogue_cert,
                rogue_key,
                "store's tensor_tls_client_ca did not sign this client's tensor_tls_cert",
            ),
        )
        for cert_file, key_file, why in refusals:
            async with TensorStoreClient(srv.address, tls_ca=ca.file, tls_cert=cert_file, tls_key=key_file,
                                         timeout_s=3) as refused:  # fmt: skip
                with pytest.raises(TensorStoreUnavailable, match=f"{srv.address} is unreachable.*{why}"):
                    await refused.fetch(ref)
        assert srv.keys == [ref.key]
    finally:
        await srv.stop(grace=None)


@pytest.mark.timeout(60)
async def test_worker_stores_and_clients_speak_mtls_from_their_settings(tmp_path: Path) -> None:
    """What every tier does: its store from its TensorPlaneSettings, its clients from the same."""
    ca = CA(tmp_path, "run-ca")
    rollout_cert, rollout_key = ca.issue("rollout")
    trainer_cert, trainer_key = ca.issue("trainer")
    rollout = TensorPlaneSettings(bind_host="0.0.0.0", advertise_host="127.0.0.1", tensor_tls_ca=ca.file,
                                  tensor_tls_cert=rollout_cert, tensor_tls_key=rollout_key,
                                  tensor_tls_client_ca=ca.file)  # fmt: skip
    trainer = TensorPlaneSettings(
        tensor_tls_cert=trainer_cert, tensor_tls_key=trainer_key, tensor_tls_ca=ca.file
    )
    store = await worker_store(rollout, capacity_bytes=1 << 20, ttl_s=60)
    try:
        assert store.tls and store.address.startswith("127.0.0.1:")
        ref = store.put_local("rollout/job-1", {"x": torch.ones(4)})
        async with worker_client(ref.address, trainer) as client:
            assert torch.equal((await client.fetch(ref))["x"], torch.ones(4))
        async with worker_client(ref.address, TensorPlaneSettings(tensor_tls_ca=ca.file)) as anonymous:
            anonymous.timeout_s = 3
            with pytest.raises(TensorStoreUnavailable):
                await anonymous.fetch(ref)
    finally:
        await store.stop(grace=None)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_embedded_run_trains_over_mutual_tls(tmp_path: Path, tiny_model_dir: Path, procs) -> None:
    """Every store and client of every tier takes the run's settings: a run whose stores all require
    client certificates trains (rollout to reward and to both trainer ranks, weights to the rollout
    worker, the controller's sample table), and a client without a certificate reads nothing."""
    from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig

    ca = CA(tmp_path, "run-ca")
    cert, key = ca.issue("fleet")
    data = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_digits.jsonl"
    config = TrainerConfig(
        rollout_batch_size=4, train_batch_size=4, group_size=2, max_prompt_length=32, max_response_length=8,
        num_train_workers=2, output_dir=str(tmp_path / "run"), loggers=["jsonl"], sample_table_size=2,
        device="cpu", tensor_plane=TensorPlaneSettings(tensor_tls_cert=cert, tensor_tls_key=key,
                                                       tensor_tls_ca=ca.file, tensor_tls_client_ca=ca.file),
    )  # fmt: skip
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789",
                          PromptDataset(str(data), max_prompt_length=32, seed=1), config)  # fmt: skip
    published = []
    try:
        trainer.start()
        fleet = trainer.fleet
        publish = fleet.publish_weights

        async def watched(*args, **kwargs):
            done = await publish(*args, **kwargs)
            published.append(done)
            return done

        fleet.publish_weights = watched  # type: ignore[method-assign]
        results = list(trainer.steps(max_steps=2))
        assert [r.step for r in results] == [1, 2] and [r.weight_version for r in results] == [1, 2]
        bucket = published[-1].buckets[0]

        async def read() -> None:
            async with TensorStoreClient(bucket.address, tls_ca=ca.file, tls_cert=cert, tls_key=key) as ok:
                assert await ok.fetch(bucket)
            async with TensorStoreClient(bucket.address, tls_ca=ca.file, timeout_s=3) as anonymous:
                with pytest.raises(TensorStoreUnavailable, match="without a certificate"):
                    await anonymous.fetch(bucket)

        trainer.run(read())
        trainer.finish()  # the "after" sample table: the controller reads answers over mTLS
        assert "Sample answers" in (trainer.output_dir / "samples.md").read_text()
        started = procs.launched(trainer.output_dir)
    finally:
        trainer.close()
    assert procs.survivors(started) == []
