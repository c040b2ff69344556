"""The TensorStore gRPC client (``grpc.aio``): put, get, fetch by :class:`TensorRef`, delete, stat.

Errors come back as the tensor-plane exceptions of :mod:`rlfleet.common.errors` (see
:mod:`rlfleet.common.tensors.rpc`), whichever end found the problem: ``UnknownKey`` for a key the
server does not hold, ``StoreFull`` for a put over its capacity, ``ChecksumMismatch`` for bytes
damaged on the way, ``TensorStoreUnavailable`` for a server that cannot be reached.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence

import grpc
import torch

from rlfleet.common.errors import MessageTooLarge, TransportClosed
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors._gen import tensors_pb2 as pb
from rlfleet.common.tensors.codec import (
    CHUNK_HINT,
    DEFAULT_CHUNK_BYTES,
    PHYSICAL_MEMORY_BYTES,
    Chunk,
    ChunkAssembler,
    dtype_name,
    keep_stream_buffers,
    split_tensors,
)
from rlfleet.common.tensors.local import StoreStat, TensorInfo
from rlfleet.common.tensors.rpc import channel_options, check_sizes, error_from_rpc, method
from rlfleet.common.tensors.wire import decode_chunk, encode_chunk

logger = logging.getLogger(__name__)


class TensorStoreClient:
    """A connection to one TensorStore server. Create it inside the event loop that uses it.

    ``chunk_bytes`` is the payload size of the chunks it sends; ``max_message_bytes`` the largest
    chunk payload it accepts; ``max_get_bytes`` the most one ``get`` may make it allocate.
    """

    def __init__(
        self,
        address: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = 64 << 20,
        max_get_bytes: int | None = PHYSICAL_MEMORY_BYTES,
    ) -> None:
        check_sizes(chunk_bytes, max_message_bytes)
        keep_stream_buffers()
        self.address = address
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.max_get_bytes = max_get_bytes
        self._channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))
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
        self._peers: dict[str, TensorStoreClient] = {}
        self._limit: int | None = None
        self._closed = False

    async def put(self, key: str, tensors: Mapping[str, torch.Tensor]) -> TensorRef:
        """Stream ``tensors`` to the server under ``key`` (replacing any entry there).

        Checks dtypes before sending anything (:class:`UnknownDtype`); :class:`StoreFull` when the
        server has no room, in which case nothing was stored. Chunks are ``chunk_bytes`` long, or
        the server's limit where that is smaller.
        """
        for name, tensor in tensors.items():
            dtype_name(tensor.dtype, name)
        chunk_bytes = min(self.chunk_bytes, await self._server_limit())
        return await self.put_chunks(split_tensors(key, tensors, chunk_bytes))

    async def put_chunks(self, chunks: Iterable[Chunk] | AsyncIterable[Chunk]) -> TensorRef:
        """Send a ready-made chunk stream as one put (what :meth:`put` does with its tensors).

        A chunk over the server's limit raises :class:`MessageTooLarge` before it is sent. The
        server checks the rest: a stream that is malformed, damaged or lacks its end marker raises
        here, and the store stays as it was (so it does when this call is cancelled).
        """
        limit = await self._server_limit()
        call = self._put_rpc()
        try:
            async for chunk in _each(chunks):
                if len(chunk.data) > limit:
                    raise MessageTooLarge(len(chunk.data), limit, "tensor chunk", CHUNK_HINT)
                await call.write(encode_chunk(chunk))
            await call.done_writing()
            summary: pb.PutSummary = await call
        except grpc.RpcError as err:
            raise error_from_rpc(err, self.address, await _initial_metadata(call)) from None
        finally:
            if not call.done():
                call.cancel()
        return TensorRef(address=self.address, key=summary.key, nbytes=summary.nbytes)

    async def get(self, key: str, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors under ``key`` (all, or only ``names``), checked chunk by chunk on arrival."""
        self._check_open()
        assembler = ChunkAssembler(
            key, max_chunk_bytes=self.max_message_bytes, max_total_bytes=self.max_get_bytes
        )
        request = pb.GetRequest(key=key, names=list(names or ()), max_chunk_bytes=self.max_message_bytes)
        call = self._get_rpc(request)
        try:
            async for message in call:
                assembler.feed(decode_chunk(message))
        except grpc.RpcError as err:
            raise error_from_rpc(err, self.address) from None
        finally:
            if not assembler.done:
                call.cancel()
        return assembler.finish()

    async def fetch(self, ref: TensorRef, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors a :class:`TensorRef` points to, from whichever server holds them."""
        if ref.address == self.address:
            return await self.get(ref.key, names)
        peer = self._peers.get(ref.address)
        if peer is None:
            peer = TensorStoreClient(
                ref.address,
                chunk_bytes=self.chunk_bytes,
                max_message_bytes=self.max_message_bytes,
                max_get_bytes=self.max_get_bytes,
            )
            self._peers[ref.address] = peer
        return await peer.get(ref.key, names)

    async def delete(self, key: str) -> bool:
        """Drop ``key`` on the server; False if it was not there."""
        self._check_open()
        try:
            reply: pb.DeleteReply = await self._delete_rpc(pb.DeleteRequest(key=key))
        except grpc.RpcError as err:
            raise error_from_rpc(err, self.address) from None
        return reply.deleted

    async def stat(self, key: str | None = None) -> StoreStat:
        """The server's accounting, plus ``key``'s tensors when given (:class:`UnknownKey` if absent)."""
        self._check_open()
        request = pb.StatRequest() if key is None else pb.StatRequest(key=key)
        try:
            reply: pb.StatReply = await self._stat_rpc(request)
        except grpc.RpcError as err:
            raise error_from_rpc(err, self.address) from None
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
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()
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
