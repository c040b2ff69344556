"""Deadlines on the tensor plane (issue 12, point 6): no TensorStore call waits without bound.

A real gRPC server that speaks the TensorStore protocol but stalls (a Get that sends one chunk and
then nothing, a Put that never takes a chunk, a Stat that never answers) makes the client give up
within its idle timeout (streams) or its unary deadline, with :class:`TensorStoreTimeout` naming
the store and the call, long before the stream's overall deadline. A real store serves the same
calls under the same short idle timeout, and a stream's deadline grows with its size.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from rlfleet.common.errors import TensorStoreTimeout
from rlfleet.common.tensors import client as client_module
from rlfleet.common.tensors._gen import tensors_pb2 as pb
from rlfleet.common.tensors.client import MIN_BYTES_PER_S, TensorStoreClient, stream_deadline
from rlfleet.common.tensors.codec import encode_chunk, split_tensors
from rlfleet.common.tensors.rpc import SERVICE, channel_options
from rlfleet.common.tensors.server import TensorStoreServer

MB = 1 << 20
SECRET = "s" * 32


class StallingStore:
    """A gRPC server on the TensorStore service whose Get, Put and Stat stall on purpose."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.gets = self.puts = 0
        self.stall_stat = False
        self._server: grpc.aio.Server | None = None
        self.address = ""

    async def _get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        self.gets += 1
        chunks = list(split_tensors(request.key, {"x": torch.arange(MB // 4, dtype=torch.int32)}, MB // 4))
        yield bytes(encode_chunk(chunks[0]))  # one chunk of four, then silence
        await self.release.wait()

    async def _put(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.PutSummary:
        self.puts += 1
        await self.release.wait()  # never reads: the client's writes back up
        return pb.PutSummary(key="never", nbytes=0)

    async def _stat(self, request: pb.StatRequest, context: grpc.aio.ServicerContext) -> pb.StatReply:
        if self.stall_stat:
            await self.release.wait()
        return pb.StatReply(max_message_bytes=64 * MB)

    async def start(self) -> str:
        server = grpc.aio.server(options=channel_options(64 * MB))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Get": grpc.unary_stream_rpc_method_handler(
                self._get, request_deserializer=pb.GetRequest.FromString),
            "Put": grpc.stream_unary_rpc_method_handler(
                self._put, response_serializer=pb.PutSummary.SerializeToString),
            "Stat": grpc.unary_unary_rpc_method_handler(
                self._stat, request_deserializer=pb.StatRequest.FromString,
                response_serializer=pb.StatReply.SerializeToString),
        }),))  # fmt: skip
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server, self.address = server, f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            await self._server.stop(0)


@pytest.fixture
async def stalling() -> AsyncIterator[StallingStore]:
    store = StallingStore()
    await store.start()
    try:
        yield store
    finally:
        await store.stop()


@pytest.mark.timeout(30)
async def test_a_get_whose_stream_stalls_is_cut_off_at_the_idle_timeout(stalling: StallingStore) -> None:
    async with TensorStoreClient(stalling.address, timeout_s=120.0, idle_timeout_s=1.0) as client:
        started = time.monotonic()
        with pytest.raises(TensorStoreTimeout) as caught:
            await client.get("k", capability="c")
        took = time.monotonic() - started
    assert stalling.gets == 1
    assert 0.9 < took < 10.0, f"cut off after {took:.1f}s, not at the 1 s idle timeout (deadline 120 s)"
    text = str(caught.value)
    assert stalling.address in text and "Get" in text and "stalled" in text


@pytest.mark.timeout(30)
async def test_a_put_the_server_never_takes_is_cut_off_at_the_idle_timeout(stalling: StallingStore) -> None:
    async with TensorStoreClient(stalling.address, secret=SECRET, timeout_s=120.0, idle_timeout_s=1.0,
                                 chunk_bytes=4 * MB) as client:  # fmt: skip
        started = time.monotonic()
        with pytest.raises(TensorStoreTimeout) as caught:
            await client.put("k", {"x": torch.zeros(64 * MB // 4)})  # far more than gRPC buffers
        took = time.monotonic() - started
    assert stalling.puts == 1
    assert took < 10.0, f"cut off after {took:.1f}s, not at the 1 s idle timeout"
    assert "Put" in str(caught.value) and "stalled" in str(caught.value)


@pytest.mark.timeout(30)
async def test_a_stat_that_never_answers_ends_at_the_unary_deadline(
    stalling: StallingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "UNARY_TIMEOUT_S", 1.0)
    stalling.stall_stat = True
    async with TensorStoreClient(stalling.address, secret=SECRET, timeout_s=120.0) as client:
        started = time.monotonic()
        with pytest.raises(TensorStoreTimeout) as caught:
            await client.stat()
        assert time.monotonic() - started < 10.0
    assert "Stat" in str(caught.value)


@pytest.mark.timeout(60)
async def test_a_real_store_serves_big_streams_under_a_short_idle_timeout() -> None:
    server = TensorStoreServer(capacity_bytes=256 * MB, secret=SECRET)
    await server.start()
    try:
        async with TensorStoreClient(
            server.address, secret=SECRET, idle_timeout_s=2.0, chunk_bytes=MB
        ) as client:
            tensors = {"a": torch.arange(16 * MB // 4, dtype=torch.int32), "b": torch.ones(3)}
            ref = await client.put("w", tensors)
            back = await client.fetch(ref)
        assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["b"], tensors["b"])
    finally:
        await server.stop()


def test_a_streams_deadline_grows_with_its_size() -> None:
    assert stream_deadline(300.0, 0) == 300.0
    assert stream_deadline(300.0, 10 * MIN_BYTES_PER_S) == pytest.approx(310.0)
    assert stream_deadline(300.0, 64 << 30) > 300.0 + 2000  # 64 GiB: over half an hour more
    with pytest.raises(ValueError, match="idle_timeout_s"):
        TensorStoreClient("127.0.0.1:1", idle_timeout_s=0)
