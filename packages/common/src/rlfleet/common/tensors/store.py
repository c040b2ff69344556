"""The TensorStore in one import: its gRPC server and client, and the ref that points into it.

The data plane of rlfleet: a producer stores a dict of tensors under a key
(:meth:`TensorStoreServer.put_local` in its own process, or :meth:`TensorStoreClient.put`), sends
the :class:`TensorRef` over the control plane, and a consumer streams the tensors straight from
the producer's store with :meth:`TensorStoreClient.fetch`; the controller never holds the bytes.
"""

from __future__ import annotations

from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors.client import TensorStoreClient
from rlfleet.common.tensors.local import LocalTensorStore, StoreStat, TensorInfo
from rlfleet.common.tensors.server import TensorStoreServer

__all__ = [
    "LocalTensorStore",
    "StoreStat",
    "TensorInfo",
    "TensorRef",
    "TensorStoreClient",
    "TensorStoreServer",
]
