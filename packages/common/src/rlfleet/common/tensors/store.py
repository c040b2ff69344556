"""The TensorStore in one import: its gRPC server and client, and the ref that points into it.

The data plane of rlfleet: a producer stores a dict of tensors under a key
(:meth:`TensorStoreServer.put_local` in its own process, or :meth:`TensorStoreClient.put`), sends
the :class:`TensorRef` over the control plane, and a consumer streams the tensors straight from
the producer's store with :meth:`TensorStoreClient.fetch`; the controller never holds the bytes.

:func:`worker_store` and :func:`worker_client` build both ends from a worker's
:class:`~rlfleet.common.schema.worker.TensorPlaneSettings` (bind and advertised host, TLS files);
a :class:`ClientPool` keeps one client per store address.
"""

from __future__ import annotations

from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.worker import TensorPlaneSettings
from rlfleet.common.tensors.client import ClientPool, TensorStoreClient, worker_client
from rlfleet.common.tensors.local import LocalTensorStore, StoreStat, TensorInfo
from rlfleet.common.tensors.server import TensorStoreServer


async def worker_store(
    settings: TensorPlaneSettings, *, capacity_bytes: int, ttl_s: float
) -> TensorStoreServer:
    """A worker's TensorStore, started on its ``bind_host`` and advertising ``advertise_host``; TLS
    with ``tensor_tls_cert``/``tensor_tls_key``, requiring client certificates signed by
    ``tensor_tls_client_ca`` when set (mTLS)."""
    store = TensorStoreServer(
        capacity_bytes=capacity_bytes,
        ttl_s=ttl_s,
        tls_cert=settings.tensor_tls_cert,
        tls_key=settings.tensor_tls_key,
        tls_client_ca=settings.tensor_tls_client_ca,
    )
    await store.start(host=settings.bind_host, advertise_host=settings.advertise_host)
    return store


__all__ = [
    "ClientPool",
    "LocalTensorStore",
    "StoreStat",
    "TensorInfo",
    "TensorRef",
    "TensorStoreClient",
    "TensorStoreServer",
    "worker_client",
    "worker_store",
]
