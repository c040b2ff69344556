"""The TensorStore gRPC client (``grpc.aio``): put, get, fetch by :class:`TensorRef`, delete, stat.

Errors come back as the tensor-plane exceptions of :mod:`rlfleet.common.errors` (see
:mod:`rlfleet.common.tensors.rpc`), whichever end found the problem: ``UnknownKey`` for a key the
server does not hold, ``StoreFull`` for a put over its capacity, ``ChecksumMismatch`` for bytes
damaged on the way, ``TensorStoreUnavailable`` for a server that cannot be reached,
``TensorAccessDenied`` for a call without the capability or secret it needs,
``TensorStoreTimeout`` past a call's deadline, ``TensorStoreBusy`` from a server at its RPC cap.

A process that reads from many stores keeps one client per address in a :class:`ClientPool`
(made on first use, from the worker's tensor plane settings by :func:`worker_client`, kept open,
the least recently used closed past a cap).

Every call has a deadline (issue 12, point 6): a stream (Put, Get) gets ``timeout_s`` plus the
time its bytes take at ``MIN_BYTES_PER_S`` (so a large transfer is not cut off by a deadline made
for a small one), Delete and Stat at most ``UNARY_TIMEOUT_S``. A stream that stops moving (no chunk
arrives, or the server takes none) for ``idle_timeout_s`` is cut off at once with
:class:`TensorStoreTimeout` naming the call and the stall, instead of waiting for the deadline.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, TypeVar

import grpc

from rlfleet.common.errors import MessageTooLarge, TensorStoreTimeout, TensorStoreUnavailable, TransportClosed
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.worker import TensorPlaneSettings
from rlfleet.common.tensors._gen import tensors_pb2 as pb
from rlfleet.common.tensors.codec import (
    CHUNK_HINT,
    DEFAULT_ARRAYS,
    DEFAULT_CHUNK_BYTES,
    PHYSICAL_MEMORY_BYTES,
    Arrays,
    Chunk,
    ChunkAssembler,
    Tensor,
    decode_chunk,
    dtype_name,
    encode_chunk,
    payload_nbytes,
    split_tensors,
)
from rlfleet.common.tensors.guard import bearer_metadata, capability, capability_metadata
from rlfleet.common.tensors.local import StoreStat, TensorInfo
from rlfleet.common.tensors.malloc import keep_stream_buffers
from rlfleet.common.tensors.rpc import channel_options, check_sizes, error_from_rpc, method
from rlfleet.common.tensors.tls import channel_credentials

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_TIMEOUT_S = 300.0
UNARY_TIMEOUT_S = 30.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
"""The longest a stream may sit without moving a chunk (the server cuts a silent Put at 30 s)."""
MIN_BYTES_PER_S = 32 << 20
"""The slowest transfer rate a stream's deadline allows for: 32 MiB/s on top of ``timeout_s``."""


def stream_deadline(timeout_s: float, nbytes: int) -> float:
    """A stream's deadline: ``timeout_s`` plus ``nbytes`` at :data:`MIN_BYTES_PER_S`."""
    return timeout_s + max(0, nbytes) / MIN_BYTES_PER_S


class TensorStoreClient:
    """A connection to one TensorStore server. Create it inside the event loop that uses it.

    ``chunk_bytes`` is the payload size of the chunks it sends; ``max_message_bytes`` the largest
    chunk payload it accepts; ``max_get_bytes`` the most one ``get`` may make it allocate.
    ``timeout_s`` is a stream's deadline before its size is added (:func:`stream_deadline`),
    ``idle_timeout_s`` how long a stream may move nothing before it is cut off.
    ``secret`` is the store's own (its owner may then put, delete and stat anything there);
    without it the client only reads what a ref's capability opens.
    ``tls_ca`` (a PEM file) speaks TLS to servers whose certificate it signed, with
    ``tls_cert``/``tls_key`` as this client's own certificate where the server asks for one;
    ``tls_server_name`` is the name the server's certificate must carry when ``address`` is an IP
    the caller resolved that name to (default: the address's own host).
    """

    def __init__(
        self,
        address: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = 64 << 20,
        max_get_bytes: int | None = PHYSICAL_MEMORY_BYTES,
        secret: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        tls_server_name: str = "",
    ) -> None:
        check_sizes(chunk_bytes, max_message_bytes)
        if timeout_s <= 0 or idle_timeout_s <= 0:
            raise ValueError(
                f"timeout_s and idle_timeout_s must be positive, got {timeout_s}, {idle_timeout_s}"
            )
        keep_stream_buffers()
        self.address = address
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.max_get_bytes = max_get_bytes
        self.secret = secret
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._tls = (tls_ca, tls_cert, tls_key)
        options: list[tuple[str, int | str]] = [*channel_options(max_message_bytes)]
        if tls_ca and tls_server_name:
            options = [*options, ("grpc.ssl_target_name_override", tls_server_name)]
        if tls_ca:
            credentials = channel_credentials(tls_ca, tls_cert, tls_key)
            self._channel = grpc.aio.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        self._put_rpc = self._channel.stream_unary(
            method("Put"), response_deserializer=pb.PutSummary.FromString
        )
        self._get_rpc = self._channel.unary_stream(
            method("Get"), request_serializer=pb.GetRequest.SerializeToString
        )
        self._delete_rpc = self._channel.unary_unary(
            method("Delete"),
            request_serializer=pb.DeleteRequest.SerializeToString,
            response_deserializer=pb.DeleteReply.FromString,
        )
        self._stat_rpc = self._channel.unary_unary(
            method("Stat"),
            request_serializer=pb.StatRequest.SerializeToString,
            response_deserializer=pb.StatReply.FromString,
        )
        self._peers = ClientPool(connect=self._new_peer)
        self._limit: int | None = None
        self._closed = False

    async def put(self, key: str, tensors: Mapping[str, Tensor]) -> TensorRef:
        """Stream ``tensors`` to the server (needs the store's ``secret``); the ref to read them by.

        The server stores them under ``key`` plus a random suffix (the ref's key, with the
        capability that opens it) and never overwrites. Checks dtypes before sending anything
        (:class:`UnknownDtype`); :class:`StoreFull` when the server has no room, in which case
        nothing was stored. Chunks are ``chunk_bytes`` long, or the server's limit where smaller.
        """
        for name, tensor in tensors.items():
            dtype_name(tensor.dtype, name)
        chunk_bytes = min(self.chunk_bytes, await self._server_limit())
        nbytes = sum(payload_nbytes(t) for t in tensors.values())
        return await self.put_chunks(split_tensors(key, tensors, chunk_bytes), nbytes=nbytes)

    async def put_chunks(
        self, chunks: Iterable[Chunk] | AsyncIterable[Chunk], *, nbytes: int = 0
    ) -> TensorRef:
        """Send a ready-made chunk stream as one put (what :meth:`put` does with its tensors);
        ``nbytes`` (its size, when known) lengthens the deadline (:func:`stream_deadline`).

        A chunk over the server's limit raises :class:`MessageTooLarge` before it is sent. The
        server checks the rest: a stream that is malformed, damaged or lacks its end marker raises
        here, and the store stays as it was (so it does when this call is cancelled). A server that
        takes no chunk for ``idle_timeout_s`` raises :class:`TensorStoreTimeout`.
        """
        limit = await self._server_limit()
        deadline = stream_deadline(self.timeout_s, nbytes)
        call = self._put_rpc(timeout=deadline, metadata=self._owner())
        try:
            async for chunk in _each(chunks):
                if len(chunk.data) > limit:
                    raise MessageTooLarge(len(chunk.data), limit, "tensor chunk", CHUNK_HINT)
                if call.done():
                    break  # the server ended the put (a refusal): its status, awaited below, says why
                try:
                    await self._moving(call.write(encode_chunk(chunk)), "Put")
                except asyncio.InvalidStateError:
                    break  # ended while this chunk waited to be sent
            if not call.done():
                await self._moving(call.done_writing(), "Put")
            summary: pb.PutSummary = await call
        except grpc.RpcError as err:
            initial = await _initial_metadata(call)
            raise self._failed(err, "Put", deadline, initial) from None
        finally:
            if not call.done():
                call.cancel()
        cap = capability(self.secret, summary.key) if self.secret else ""
        return TensorRef(address=self.address, key=summary.key, nbytes=summary.nbytes, capability=cap)

    async def get(
        self,
        key: str,
        names: Sequence[str] | None = None,
        *,
        capability: str = "",
        nbytes: int = 0,
        max_bytes: int | None = None,
        arrays: Arrays = DEFAULT_ARRAYS,
    ) -> dict[str, Tensor]:
        """The tensors under ``key`` (all, or only ``names``), checked chunk by chunk on arrival.

        Needs the key's ``capability`` (see :meth:`fetch`, which takes it from the ref) or the
        store's secret; else :class:`TensorAccessDenied`. ``nbytes`` (the size, when known)
        lengthens the deadline; a stream with no chunk for ``idle_timeout_s`` raises
        :class:`TensorStoreTimeout`. ``max_bytes`` caps what this call may allocate below the
        client's ``max_get_bytes``: a stream past it is cut off with :class:`MessageTooLarge`
        before the tensor that would cross it is allocated. ``arrays="numpy"`` returns numpy arrays
        (the default where torch is not installed; a bf16 or fp8 tensor is then ``UnknownDtype``).
        """
        self._check_open()
        limit = self.max_get_bytes if max_bytes is None else min(max_bytes, self.max_get_bytes or max_bytes)
        assembler = ChunkAssembler(
            key, max_chunk_bytes=self.max_message_bytes, max_total_bytes=limit, arrays=arrays
        )
        request = pb.GetRequest(key=key, names=list(names or ()), max_chunk_bytes=self.max_message_bytes)
        deadline = stream_deadline(self.timeout_s, nbytes)
        call = self._get_rpc(request, timeout=deadline, metadata=self._reader(capability))
        try:
            while (message := await self._moving(call.read(), "Get")) is not grpc.aio.EOF:
                assembler.feed(decode_chunk(message))
        except grpc.RpcError as err:
            raise self._failed(err, "Get", deadline) from None
        finally:
            if not assembler.done:
                call.cancel()
        return assembler.finish()

    async def _moving(self, step: Awaitable[T], rpc: str) -> T:
        """``step`` (one read or write of a stream), cut off after ``idle_timeout_s`` without progress."""
        try:
            return await asyncio.wait_for(step, self.idle_timeout_s)
        except TimeoutError:
            idle = self.idle_timeout_s
            raise TensorStoreTimeout(
                self.address, f"{rpc} (stalled: no chunk moved for {idle:g}s)", idle
            ) from None

    async def fetch(self, ref: TensorRef, names: Sequence[str] | None = None) -> dict[str, Tensor]:
        """The tensors a :class:`TensorRef` points to, from whichever server holds them (the ref's
        size lengthens the deadline when all its tensors are read)."""
        nbytes = ref.nbytes if not names else 0
        client = self if ref.address == self.address else self._peers.get(ref.address)
        return await client.get(ref.key, names, capability=ref.capability, nbytes=nbytes)

    def _new_peer(self, address: str) -> TensorStoreClient:
        """A client for another store, with this one's limits, deadline and TLS (never its secret)."""
        tls_ca, tls_cert, tls_key = self._tls
        return TensorStoreClient(
            address,
            chunk_bytes=self.chunk_bytes,
            max_message_bytes=self.max_message_bytes,
            max_get_bytes=self.max_get_bytes,
            timeout_s=self.timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )

    def _owner(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.secret) if self.secret else ()

    def _reader(self, cap: str) -> tuple[tuple[str, str], ...]:
        return self._owner() + capability_metadata(cap)

    def _failed(
        self, err: grpc.RpcError, rpc: str, timeout: float, initial: tuple[tuple[str, str | bytes], ...] = ()
    ) -> Exception:
        """The tensor-plane error of a failed call; an unreachable store's says what TLS may have refused
        (gRPC reports a failed handshake only as a closed socket)."""
        error = error_from_rpc(err, self.address, initial, rpc=rpc, timeout=timeout)
        if not isinstance(error, TensorStoreUnavailable):
            return error
        tls_ca, tls_cert, _ = self._tls
        if not tls_ca:
            hint = "a store that serves TLS refuses plain clients (set tensor_tls_ca)"
        elif not tls_cert:
            hint = (
                "this client speaks TLS without a certificate of its own: a store that requires one "
                "(mTLS, tensor_tls_client_ca) refuses the handshake; set tensor_tls_cert and tensor_tls_key"
            )
        else:
            hint = (
                "the TLS handshake fails when tensor_tls_ca did not sign the store's certificate, or the "
                "store's tensor_tls_client_ca did not sign this client's tensor_tls_cert"
            )
        return TensorStoreUnavailable(self.address, f"{error.detail}; if the store is up: {hint}")

    @property
    def _unary_timeout(self) -> float:
        return min(self.timeout_s, UNARY_TIMEOUT_S)

    async def delete(self, key: str | TensorRef) -> bool:
        """Drop a key (or a ref's) on the server; False if it was not there.

        Only the store's owner may: it needs the client's ``secret`` (:class:`TensorAccessDenied`
        without it; a ref's capability only reads).
        """
        self._check_open()
        name = key.key if isinstance(key, TensorRef) else key
        try:
            reply: pb.DeleteReply = await self._delete_rpc(
                pb.DeleteRequest(key=name), timeout=self._unary_timeout, metadata=self._owner()
            )
        except grpc.RpcError as err:
            raise self._failed(err, "Delete", self._unary_timeout) from None
        return reply.deleted

    async def stat(self, key: str | TensorRef | None = None) -> StoreStat:
        """The server's accounting, plus a key's tensors when given (:class:`UnknownKey` if absent).

        Store-wide, it needs the store's secret; for a key, that or the ref's capability.
        """
        self._check_open()
        name, cap = (key.key, key.capability) if isinstance(key, TensorRef) else (key, "")
        request = pb.StatRequest() if name is None else pb.StatRequest(key=name)
        try:
            reply: pb.StatReply = await self._stat_rpc(
                request, timeout=self._unary_timeout, metadata=self._reader(cap)
            )
        except grpc.RpcError as err:
            raise self._failed(err, "Stat", self._unary_timeout) from None
        return StoreStat(
            used_bytes=reply.used_bytes,
            capacity_bytes=reply.capacity_bytes,
            key_count=reply.key_count,
            tensors=tuple(TensorInfo(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in reply.tensors),
            expires_in_s=reply.expires_in_s if key is not None else None,
            max_message_bytes=reply.max_message_bytes,
        )

    async def close(self) -> None:
        """Close the channel (and those opened by :meth:`fetch`); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        await self._peers.close()
        await self._channel.close()

    async def __aenter__(self) -> TensorStoreClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _server_limit(self) -> int:
        """The largest chunk payload the server accepts (asked once, then remembered)."""
        self._check_open()
        if self._limit is None:
            self._limit = (await self.stat()).max_message_bytes or self.max_message_bytes
        return self._limit

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"TensorStoreClient for {self.address}")


def worker_client(
    address: str, settings: TensorPlaneSettings, *, tls_server_name: str = ""
) -> TensorStoreClient:
    """A client for another tier's store, speaking TLS when the worker trusts a CA (``tensor_tls_ca``),
    with ``tensor_tls_cert``/``tensor_tls_key`` as its own certificate for stores that ask for one
    (``tls_server_name``: the name the certificate must carry when ``address`` is a resolved IP)."""
    if not settings.tensor_tls_ca:
        return TensorStoreClient(address)
    return TensorStoreClient(
        address,
        tls_ca=settings.tensor_tls_ca,
        tls_cert=settings.tensor_tls_cert,
        tls_key=settings.tensor_tls_key,
        tls_server_name=tls_server_name,
    )


FETCHES_AT_ONCE = 4
"""Streams :meth:`ClientPool.fetch_all` keeps open at once (a weight version's buckets)."""


class ClientPool:
    """One open :class:`TensorStoreClient` per store address, made on first use.

    Clients come from ``connect`` (default: :func:`worker_client` with ``settings``, so they speak
    TLS when the worker trusts a CA). With ``max_clients``, making one more closes the least
    recently used first (a shared reward server meets many tenants' stores); a fetch still running
    on it then fails. :meth:`close` closes every client; the pool can be used again after it.
    Use it inside the event loop its clients run in.
    """

    def __init__(
        self,
        settings: TensorPlaneSettings | None = None,
        *,
        max_clients: int | None = None,
        connect: Callable[[str], TensorStoreClient] | None = None,
    ) -> None:
        if max_clients is not None and max_clients < 1:
            raise ValueError(f"max_clients must be at least 1 (or None: no cap), got {max_clients}")
        plane = settings or TensorPlaneSettings()
        self._connect = connect or functools.partial(worker_client, settings=plane)
        self.max_clients = max_clients
        self._clients: dict[str, TensorStoreClient] = {}  # least recently used first
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, address: object) -> bool:
        return address in self._clients

    def get(self, address: str) -> TensorStoreClient:
        """The client of ``address``: the open one, or a new one (closing the least recently used
        past ``max_clients``)."""
        client = self._clients.pop(address, None)
        if client is None:
            client = self._connect(address)
            while self.max_clients is not None and len(self._clients) >= self.max_clients:
                oldest = next(iter(self._clients))
                self._close_later(oldest, self._clients.pop(oldest))
        self._clients[address] = client  # last: the most recently used
        return client

    async def fetch(self, ref: TensorRef, names: Sequence[str] | None = None) -> dict[str, Tensor]:
        """The tensors ``ref`` names (all of them without ``names``), from the store that holds them."""
        return await self.get(ref.address).fetch(ref, names)

    async def fetch_all(
        self, refs: Sequence[TensorRef], at_once: int = FETCHES_AT_ONCE
    ) -> list[dict[str, Tensor]]:
        """Every ref's tensors, in ``refs``' order, ``at_once`` streams at a time (a bucket of many
        small tensors, a weight delta's above all, costs more in per-message work than in bytes).
        The first failure cancels the others and is raised as it came."""
        tasks = self._fetch_tasks(refs, at_once)
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            await _cancel(tasks)

    async def fetch_into(
        self,
        refs: Sequence[TensorRef],
        consume: Callable[[Iterator[dict[str, Tensor]]], R],
        at_once: int = FETCHES_AT_ONCE,
    ) -> R:
        """``consume`` run on a thread over the refs' tensors, each ref's as soon as it has come (in
        the order they come), so that its work on one overlaps the pull of the next; its result.
        A failed pull reaches ``consume`` as the error its iterator raises; ``consume`` ending early
        (or this call cancelled) cancels the pulls left, and the iterator then raises too."""
        tasks = self._fetch_tasks(refs, at_once)
        came: queue.SimpleQueue[dict[str, Tensor] | BaseException | None] = queue.SimpleQueue()

        async def pull() -> None:
            try:
                for done in asyncio.as_completed(tasks):
                    came.put(await done)
                came.put(None)
            except BaseException as exc:  # a failed pull, or cancelled: the consumer stops on it
                came.put(exc)

        def each() -> Iterator[dict[str, Tensor]]:
            while (item := came.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item

        feeder = asyncio.create_task(pull())
        try:
            return await asyncio.to_thread(consume, each())
        finally:
            await _cancel([feeder, *tasks])

    def _fetch_tasks(self, refs: Sequence[TensorRef], at_once: int) -> list[asyncio.Task[dict[str, Tensor]]]:
        """One task a ref, ``at_once`` of them pulling at a time."""
        if at_once < 1:
            raise ValueError(f"at_once must be at least 1, got {at_once}")
        gate = asyncio.Semaphore(at_once)

        async def one(ref: TensorRef) -> dict[str, Tensor]:
            async with gate:
                return await self.fetch(ref)

        return [asyncio.create_task(one(ref)) for ref in refs]

    def _close_later(self, address: str, client: TensorStoreClient) -> None:
        task = asyncio.create_task(client.close(), name=f"close-store-client-{address}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every client (and wait for those closed past the cap); safe to call twice."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
        await asyncio.gather(*self._closing, return_exceptions=True)


async def _cancel(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel the tasks still running and wait for all of them (their errors are their owners')."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _initial_metadata(call: grpc.aio.StreamUnaryCall) -> tuple[tuple[str, str | bytes], ...]:
    """A failed call's initial metadata, where a Put's error may be (see ``tensor_rpc.abort_rpc``)."""
    try:
        return tuple(await asyncio.wait_for(call.initial_metadata(), timeout=5.0) or ())
    except (TimeoutError, grpc.RpcError):
        return ()


async def _each(chunks: Iterable[Chunk] | AsyncIterable[Chunk]) -> AsyncIterator[Chunk]:
    """The chunks one by one, as they are made (so memory holds one encoded chunk at a time)."""
    if isinstance(chunks, AsyncIterable):
        async for chunk in chunks:
            yield chunk
    else:
        for chunk in chunks:
            yield chunk
