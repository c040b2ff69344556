"""The TensorStore gRPC server (``grpc.aio``): a :class:`LocalTensorStore` served over the network.

Producers put their results here (over the wire with ``Put``, or in-process with
:meth:`TensorStoreServer.put_local`) and pass a :class:`TensorRef` on the control plane; consumers
stream them straight from here with ``Get``. Chunks travel as raw protobuf bytes through
:mod:`rlfleet.common.tensors.wire` (no payload copies beyond the one into or out of the tensor).

Bad input never takes the server down: every tensor-plane error ends only its own RPC (see
:mod:`rlfleet.common.tensors.rpc` for how it reaches the client), and a put that fails or is cut
off is dropped with its reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Mapping, Sequence

import grpc
import torch

from rlfleet.common.errors import MessageTooLarge, RlfleetError, TensorError
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors._gen import tensors_pb2 as pb
from rlfleet.common.tensors.codec import (
    DEFAULT_CHUNK_BYTES,
    ChunkAssembler,
    keep_stream_buffers,
    split_tensors,
)
from rlfleet.common.tensors.local import LocalTensorStore
from rlfleet.common.tensors.rpc import SERVICE, abort_rpc, channel_options, check_sizes
from rlfleet.common.tensors.wire import decode_chunk, encode_chunk

logger = logging.getLogger(__name__)

_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


class TensorStoreServer:
    """A TensorStore on ``host:port``: keyed dicts of tensors with a byte capacity and a TTL.

    ``chunk_bytes`` is the payload size of the chunks it streams out; ``max_message_bytes`` the
    largest chunk payload it accepts (and gRPC's message limit, plus header room).
    """

    def __init__(
        self,
        *,
        capacity_bytes: int = 4 << 30,
        ttl_s: float = 600.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        check_sizes(chunk_bytes, max_message_bytes)
        keep_stream_buffers()
        self.store = LocalTensorStore(capacity_bytes=capacity_bytes, ttl_s=ttl_s)
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.address = ""
        self._server: grpc.aio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: any free port); returns the ``host:port`` clients should use.

        On a wildcard host (``0.0.0.0``, ``::``) the address names this machine's hostname.
        """
        if self._server is not None:
            raise RuntimeError(f"TensorStoreServer already started at {self.address}")
        bind_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        server = grpc.aio.server(options=channel_options(self.max_message_bytes))
        server.add_generic_rpc_handlers((self._handlers(),))
        bound = server.add_insecure_port(f"{bind_host}:{port}")
        if bound == 0:
            raise OSError(f"TensorStoreServer cannot listen on {bind_host}:{port}")
        await server.start()
        self._server = server
        advertised = socket.gethostname() if host in _WILDCARD_HOSTS else bind_host
        self.address = f"{advertised}:{bound}"
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        logger.info("TensorStore serving on %s (capacity %d bytes)", self.address, self.capacity_bytes)
        return self.address

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving (in-flight RPCs get ``grace`` seconds); the stored tensors stay readable locally."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
            logger.info("TensorStore at %s stopped", self.address)

    async def _sweep(self) -> None:
        """Free expired entries even when nobody calls in (every access also purges them)."""
        interval = min(max(self.store.ttl_s / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            self.store.purge_expired()

    # --- same-process access -----------------------------------------------------------------

    def put_local(self, key: str, tensors: Mapping[str, torch.Tensor]) -> TensorRef:
        """Store tensors without the network (kept by reference); a ref others can ``fetch``."""
        nbytes = self.store.put(key, tensors)
        return TensorRef(address=self.address, key=key, nbytes=nbytes)

    def get_local(self, key: str, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """The stored tensors themselves (shared: do not modify them in place)."""
        return self.store.get(key, names)

    def delete(self, key: str) -> bool:
        """Drop ``key``; False if it was not there."""
        return self.store.delete(key)

    @property
    def used_bytes(self) -> int:
        return self.store.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.store.capacity_bytes

    @property
    def keys(self) -> list[str]:
        return self.store.keys

    # --- RPC handlers ------------------------------------------------------------------------

    def _handlers(self) -> grpc.GenericRpcHandler:
        # Put's requests and Get's responses stay raw bytes: tensor_wire encodes them.
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Put": grpc.stream_unary_rpc_method_handler(
                    self._put, response_serializer=pb.PutSummary.SerializeToString
                ),
                "Get": grpc.unary_stream_rpc_method_handler(
                    self._get, request_deserializer=pb.GetRequest.FromString
                ),
                "Delete": grpc.unary_unary_rpc_method_handler(
                    self._delete,
                    request_deserializer=pb.DeleteRequest.FromString,
                    response_serializer=pb.DeleteReply.SerializeToString,
                ),
                "Stat": grpc.unary_unary_rpc_method_handler(
                    self._stat,
                    request_deserializer=pb.StatRequest.FromString,
                    response_serializer=pb.StatReply.SerializeToString,
                ),
            },
        )

    async def _put(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.PutSummary:
        reservation = self.store.reserve()
        assembler = ChunkAssembler(max_chunk_bytes=self.max_message_bytes, reserve=reservation.add)
        try:
            async for message in requests:
                assembler.feed(decode_chunk(message))
            tensors = assembler.finish()
            nbytes = reservation.commit(assembler.key or "", tensors)
        except (TensorError, MessageTooLarge) as exc:
            logger.warning("TensorStore %s refused a put of key %r: %s", self.address, assembler.key, exc)
            await abort_rpc(context, exc, early=True)
        finally:
            reservation.release()
        return pb.PutSummary(key=assembler.key, nbytes=nbytes, tensor_count=len(tensors))

    async def _get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            tensors = self.store.get(request.key, list(request.names) or None)
        except (TensorError, MessageTooLarge) as exc:
            await abort_rpc(context, exc)
        # The caller's receive limit wins over our preferred chunk size.
        chunk_bytes = min(self.chunk_bytes, request.max_chunk_bytes or self.chunk_bytes)
        for chunk in split_tensors(request.key, tensors, chunk_bytes):
            yield encode_chunk(chunk)

    async def _delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteReply:
        return pb.DeleteReply(deleted=self.store.delete(request.key))

    async def _stat(self, request: pb.StatRequest, context: grpc.aio.ServicerContext) -> pb.StatReply:
        try:
            stat = self.store.stat(request.key if request.HasField("key") else None)
        except RlfleetError as exc:
            await abort_rpc(context, exc)
        return pb.StatReply(
            used_bytes=stat.used_bytes,
            capacity_bytes=stat.capacity_bytes,
            key_count=stat.key_count,
            tensors=[
                pb.TensorInfo(name=t.name, dtype=t.dtype, shape=list(t.shape), nbytes=t.nbytes)
                for t in stat.tensors
            ],
            expires_in_s=stat.expires_in_s or 0.0,
            max_message_bytes=self.max_message_bytes,
        )
