"""The TensorStore gRPC server (``grpc.aio``): a :class:`LocalTensorStore` served over the network.

Producers put their results here (over the wire with ``Put``, or in-process with
:meth:`TensorStoreServer.put_local`) and pass a :class:`TensorRef` on the control plane; consumers
stream them straight from here with ``Get``. Chunks travel as raw protobuf bytes through
:mod:`rlfleet.common.tensors.codec` (no payload copies beyond the one into or out of the tensor).

Bad input never takes the server down: every tensor-plane error ends only its own RPC (see
:mod:`rlfleet.common.tensors.rpc` for how it reaches the client), and a put that fails or is cut
off is dropped with its reservation.

Guarded (see :mod:`rlfleet.common.tensors.guard`): ``Get`` and a key's ``Stat`` need the key's
capability (carried in the ref the store handed out) or the store's secret; ``Put``, ``Delete`` and
a store-wide ``Stat`` need the secret (a reader cannot release a key others still need). Keys get
a random suffix and a put never overwrites. Each server caps its concurrent RPCs, refuses chunks
under ``min_chunk_bytes`` (but a tensor's last), cuts off a ``Put`` stream that sends nothing for
``idle_timeout_s``, and serves TLS when given a certificate (mTLS when also given a client CA).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Mapping, Sequence

import grpc

from rlfleet.common.errors import (
    MalformedChunk,
    MessageTooLarge,
    RlfleetError,
    StreamTruncated,
    TensorAccessDenied,
    TensorError,
)
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors._gen import tensors_pb2 as pb
from rlfleet.common.tensors.codec import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    ChunkAssembler,
    Tensor,
    decode_chunk,
    encode_chunk,
    split_tensors,
)
from rlfleet.common.tensors.guard import StoreGuard, unpredictable_key
from rlfleet.common.tensors.local import LocalTensorStore
from rlfleet.common.tensors.malloc import keep_stream_buffers
from rlfleet.common.tensors.rpc import SERVICE, abort_rpc, channel_options, check_sizes
from rlfleet.common.tensors.tls import server_credentials

logger = logging.getLogger(__name__)

_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}
DEFAULT_MIN_CHUNK_BYTES = 4 << 10
DEFAULT_MAX_CONCURRENT_RPCS = 64
DEFAULT_IDLE_TIMEOUT_S = 30.0


class TensorStoreServer:
    """A TensorStore on ``host:port``: keyed dicts of tensors with a byte capacity and a TTL.

    ``chunk_bytes`` is the payload size of the chunks it streams out; ``max_message_bytes`` the
    largest chunk payload it accepts (and gRPC's message limit, plus header room);
    ``min_chunk_bytes`` the smallest it accepts or sends (a tensor's last chunk may be shorter).
    ``secret`` (random when not given) guards it; ``tls_cert``/``tls_key`` (PEM files) turn on
    TLS, and ``tls_client_ca`` also asks clients for a certificate it signed (mTLS).
    """

    def __init__(
        self,
        *,
        capacity_bytes: int = 4 << 30,
        ttl_s: float = 600.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = 64 << 20,
        min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
        max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        secret: str | None = None,
        tls_cert: str = "",
        tls_key: str = "",
        tls_client_ca: str = "",
    ) -> None:
        check_sizes(chunk_bytes, max_message_bytes)
        if not 0 < min_chunk_bytes <= chunk_bytes:
            raise ValueError(
                f"min_chunk_bytes ({min_chunk_bytes}) must be positive and at most chunk_bytes "
                f"({chunk_bytes})"
            )
        if max_concurrent_rpcs < 1 or idle_timeout_s <= 0:
            raise ValueError(
                f"max_concurrent_rpcs ({max_concurrent_rpcs}) and idle_timeout_s ({idle_timeout_s}) "
                "must be positive"
            )
        keep_stream_buffers()
        self.store = LocalTensorStore(capacity_bytes=capacity_bytes, ttl_s=ttl_s)
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.min_chunk_bytes = min_chunk_bytes
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.idle_timeout_s = idle_timeout_s
        self.guard = StoreGuard(secret)
        tls = tls_cert or tls_key or tls_client_ca
        self._credentials = server_credentials(tls_cert, tls_key, tls_client_ca) if tls else None
        self.address = ""
        self._server: grpc.aio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def secret(self) -> str:
        """The store's secret: the bearer token of its owner's remote Put, Delete and Stat."""
        return self.guard.secret

    @property
    def tls(self) -> bool:
        return self._credentials is not None

    async def start(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str = "") -> str:
        """Listen on ``host:port`` (0: any free port); returns the ``host:port`` clients should use.

        The address (and every ref's) names ``advertise_host`` when given (a name or IP the other
        tiers can route to), else ``host``, or on a wildcard host (``0.0.0.0``, ``::``) this
        machine's hostname.
        """
        if self._server is not None:
            raise RuntimeError(f"TensorStoreServer already started at {self.address}")
        bind_host = _bracket(host)
        server = grpc.aio.server(
            options=channel_options(self.max_message_bytes), maximum_concurrent_rpcs=self.max_concurrent_rpcs
        )
        server.add_generic_rpc_handlers((self._handlers(),))
        target = f"{bind_host}:{port}"
        try:
            bound = (
                server.add_secure_port(target, self._credentials)
                if self._credentials is not None
                else server.add_insecure_port(target)
            )
        except RuntimeError as exc:  # grpc raises instead of returning 0 on some versions
            raise OSError(f"TensorStoreServer cannot listen on {target}: {exc}") from None
        if bound == 0:
            raise OSError(f"TensorStoreServer cannot listen on {target}")
        await server.start()
        self._server = server
        if advertise_host:
            advertised = _bracket(advertise_host)
        else:
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

    def put_local(self, key: str, tensors: Mapping[str, Tensor]) -> TensorRef:
        """Store tensors without the network (kept by reference); a ref others can ``fetch``.

        The stored key is ``key`` plus a random suffix (the ref's ``key``); the ref carries the
        capability that opens it.
        """
        stored = unpredictable_key(key)
        nbytes = self.store.put(stored, tensors)
        return self.ref(stored, nbytes)

    def ref(self, key: str, nbytes: int = 0) -> TensorRef:
        """The ref to a key of this store, with the capability that opens it."""
        return TensorRef(address=self.address, key=key, nbytes=nbytes, capability=self.guard.capability(key))

    def get_local(self, key: str, names: Sequence[str] | None = None) -> dict[str, Tensor]:
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

    async def _refuse(
        self, context: grpc.aio.ServicerContext, key: str, reason: str, *, early: bool = False
    ) -> None:
        logger.warning(
            "TensorStore %s refused a call on key %r from %s: %s", self.address, key, context.peer(), reason
        )
        await abort_rpc(context, TensorAccessDenied(key, self.address, reason), early=early)

    async def _put(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.PutSummary:
        if not self.guard.is_owner(context.invocation_metadata()):
            await self._refuse(context, "", "a put needs the store's secret", early=True)
        reservation = self.store.reserve()
        assembler = ChunkAssembler(max_chunk_bytes=self.max_message_bytes, reserve=reservation.add)
        stored = ""
        try:
            messages = aiter(requests)
            while not assembler.done:
                try:
                    message = await asyncio.wait_for(anext(messages), self.idle_timeout_s)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise StreamTruncated(
                        assembler.key or "", f"no chunk for {self.idle_timeout_s:g}s (stalled stream cut off)"
                    ) from None
                chunk = decode_chunk(message)
                self._check_chunk_size(chunk)
                assembler.feed(chunk)
            tensors = assembler.finish()
            stored = unpredictable_key(assembler.key or "") if assembler.key else ""
            nbytes = reservation.commit(stored, tensors)
        except (TensorError, MessageTooLarge) as exc:
            logger.warning("TensorStore %s refused a put of key %r: %s", self.address, assembler.key, exc)
            await abort_rpc(context, exc, early=True)
        finally:
            reservation.release()
        return pb.PutSummary(key=stored, nbytes=nbytes, tensor_count=len(tensors))

    def _check_chunk_size(self, chunk: Chunk) -> None:
        """Refuse chunks under the minimum, except a tensor's last (a floor on per-chunk work)."""
        if chunk.end_of_stream or len(chunk.data) >= self.min_chunk_bytes:
            return
        if chunk.offset + len(chunk.data) != chunk.total_bytes:
            raise MalformedChunk(
                f"chunk of {len(chunk.data)} bytes is under this store's minimum of {self.min_chunk_bytes} "
                "(only a tensor's last chunk may be shorter)",
                chunk.key,
                chunk.name,
            )

    async def _get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if not self.guard.may_open(request.key, context.invocation_metadata()):
            await self._refuse(context, request.key, "no valid capability for this key")
        if request.max_chunk_bytes and request.max_chunk_bytes < self.min_chunk_bytes:
            await abort_rpc(context, MessageTooLarge(
                self.min_chunk_bytes, request.max_chunk_bytes, "smallest chunk this store sends",
                "accept chunks of at least min_chunk_bytes"))  # fmt: skip
        try:
            tensors = self.store.get(request.key, list(request.names) or None)
        except (TensorError, MessageTooLarge) as exc:
            await abort_rpc(context, exc)
        # The caller's receive limit wins over our preferred chunk size.
        chunk_bytes = min(self.chunk_bytes, request.max_chunk_bytes or self.chunk_bytes)
        for chunk in split_tensors(request.key, tensors, chunk_bytes):
            yield encode_chunk(chunk)

    async def _delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteReply:
        if not self.guard.is_owner(context.invocation_metadata()):
            await self._refuse(
                context, request.key, "a delete needs the store's secret (capabilities only read)"
            )
        return pb.DeleteReply(deleted=self.store.delete(request.key))

    async def _stat(self, request: pb.StatRequest, context: grpc.aio.ServicerContext) -> pb.StatReply:
        metadata = context.invocation_metadata()
        if request.HasField("key"):
            if not self.guard.may_open(request.key, metadata):
                await self._refuse(context, request.key, "no valid capability for this key")
        elif not self.guard.is_owner(metadata):
            await self._refuse(context, "", "a store-wide stat needs the store's secret")
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


def _bracket(host: str) -> str:
    """An IPv6 literal in brackets, as gRPC targets and ``host:port`` addresses need it."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
