"""TLS for the tensor plane: gRPC credentials from PEM files (server certificate, client CA).

A store serves TLS when it is given a certificate and its key (and asks clients for certificates
of their own, mTLS, when it is also given a client CA); a client speaks TLS when it is given the
CA that signed the servers' certificates. Without them both ends stay on plain TCP.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from rlfleet.common.errors import ConfigError


def _read(path: str, field: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(field, path, f"cannot read this PEM file ({exc.strerror})") from None


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "") -> grpc.ServerCredentials:
    """A store's TLS credentials; with ``client_ca_file``, clients must present a certificate it signed."""
    if not cert_file or not key_file:
        field = "tensor_tls_key" if cert_file else "tensor_tls_cert"
        raise ConfigError(field, "", "TLS needs a certificate and its key")
    pair = (_read(key_file, "tensor_tls_key"), _read(cert_file, "tensor_tls_cert"))
    if not client_ca_file:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials(
        [pair], root_certificates=_read(client_ca_file, "tensor_tls_client_ca"), require_client_auth=True
    )


def channel_credentials(ca_file: str, cert_file: str = "", key_file: str = "") -> grpc.ChannelCredentials:
    """A client's TLS credentials: the servers' CA, plus its own certificate for mTLS when given."""
    chain = _read(cert_file, "tensor_tls_cert") if cert_file else None
    key = _read(key_file, "tensor_tls_key") if key_file else None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file, "tensor_tls_ca"), private_key=key, certificate_chain=chain
    )
