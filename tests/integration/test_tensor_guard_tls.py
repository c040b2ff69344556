"""TLS on the tensor plane: a store with a self-signed certificate made in the test, over real gRPC."""

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
from rlfleet.common.tensors.store import TensorStoreClient, TensorStoreServer


def _self_signed(tmp: Path) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = tmp / "store.pem", tmp / "store.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return str(cert_file), str(key_file)


@pytest.mark.timeout(60)
async def test_tls_store_serves_tls_clients_only(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    srv = TensorStoreServer(tls_cert=cert, tls_key=key)
    await srv.start()
    try:
        assert srv.tls
        ref = srv.put_local("k", {"x": torch.arange(10)})
        async with TensorStoreClient(srv.address, tls_ca=cert) as secure:
            assert torch.equal((await secure.fetch(ref))["x"], torch.arange(10))
        async with TensorStoreClient(srv.address, timeout_s=3) as plain:
            with pytest.raises((TensorStoreUnavailable,)):
                await plain.fetch(ref)
    finally:
        await srv.stop(grace=None)
    with pytest.raises(ConfigError, match="tensor_tls_key"):
        TensorStoreServer(tls_cert=cert)
    with pytest.raises(ConfigError, match="cannot read"):
        TensorStoreClient("127.0.0.1:1", tls_ca=str(tmp_path / "missing.pem"))
