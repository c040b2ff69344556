"""The guarded tensor plane over real gRPC: capabilities, the store secret, no overwrite, and the limits.

Each hostile call must get a clear, named refusal while the store goes on serving honest clients.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from rlfleet.common.errors import (
    KeyExists,
    MalformedChunk,
    MessageTooLarge,
    StreamTruncated,
    TensorAccessDenied,
    TensorStoreBusy,
    TensorStoreTimeout,
)
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors._gen import tensors_pb2
from rlfleet.common.tensors.codec import encode_chunk, split_tensors
from rlfleet.common.tensors.guard import bearer_metadata
from rlfleet.common.tensors.rpc import SERVICE, error_from_rpc, method
from rlfleet.common.tensors.store import TensorStoreClient, TensorStoreServer

KB = 1 << 10


@pytest.fixture
async def server() -> AsyncIterator[TensorStoreServer]:
    srv = TensorStoreServer(capacity_bytes=64 << 20, max_concurrent_rpcs=3, idle_timeout_s=0.5)
    await srv.start()
    yield srv
    await srv.stop(grace=None)


async def _round_trip(server: TensorStoreServer) -> None:
    """An honest owner's put and a reader's fetch still work."""
    async with TensorStoreClient(server.address, secret=server.secret) as owner:
        ref = await owner.put("probe", {"p": torch.arange(100)})
        async with TensorStoreClient(server.address) as reader:
            assert torch.equal((await reader.fetch(ref))["p"], torch.arange(100))
        assert await owner.delete(ref)


@pytest.mark.timeout(60)
async def test_get_needs_the_refs_capability(server: TensorStoreServer) -> None:
    ref = server.put_local("rollout/job-1", {"x": torch.ones(8)})
    other = server.put_local("rollout/job-2", {"y": torch.zeros(8)})
    async with TensorStoreClient(server.address) as reader:
        assert torch.equal((await reader.fetch(ref))["x"], torch.ones(8))
        with pytest.raises(TensorAccessDenied, match="no valid capability") as info:
            await reader.get(ref.key)  # the key alone opens nothing
        assert info.value.key == ref.key and info.value.address == server.address
        forged = [
            ref.model_copy(update={"capability": ""}),
            ref.model_copy(update={"capability": other.capability}),  # another key's capability
            ref.model_copy(update={"capability": "0" * 64}),
            ref.model_copy(update={"key": other.key}),  # ref's capability on another key
        ]
        for bad in forged:
            with pytest.raises(TensorAccessDenied):
                await reader.fetch(bad)
            with pytest.raises(TensorAccessDenied):
                await reader.stat(bad)
            with pytest.raises(TensorAccessDenied):
                await reader.delete(bad)
    assert sorted(server.keys) == sorted([ref.key, other.key])  # nothing was read or deleted
    await _round_trip(server)


@pytest.mark.timeout(60)
async def test_a_capability_reads_but_never_deletes(server: TensorStoreServer) -> None:
    """A ref holder (a reward worker, the trainer) cannot drop a batch before the others read it."""
    ref = server.put_local("rollout/job-3", {"x": torch.ones(8)})
    async with TensorStoreClient(server.address) as holder:
        with pytest.raises(TensorAccessDenied, match="delete needs the store's secret") as info:
            await holder.delete(ref)
        assert info.value.key == ref.key
        assert torch.equal((await holder.fetch(ref))["x"], torch.ones(8))  # still there, still readable
    async with TensorStoreClient(server.address, secret=server.secret) as owner:
        assert await owner.delete(ref) and server.keys == []


@pytest.mark.timeout(60)
async def test_a_capability_from_another_store_opens_nothing(server: TensorStoreServer) -> None:
    twin = TensorStoreServer()
    await twin.start()
    try:
        theirs = twin.put_local("weights/v1/0", {"w": torch.ones(4)})
        ours = server.put_local("weights/v1/0", {"w": torch.zeros(4)})
        async with TensorStoreClient(server.address) as reader:
            with pytest.raises(TensorAccessDenied):  # the other store's capability, our address and key
                await reader.fetch(
                    TensorRef(address=server.address, key=ours.key, capability=theirs.capability)
                )
            assert torch.equal((await reader.fetch(theirs))["w"], torch.ones(4))
    finally:
        await twin.stop(grace=None)


@pytest.mark.timeout(60)
async def test_put_delete_and_stat_need_the_store_secret(server: TensorStoreServer) -> None:
    tensors = {"x": torch.ones(1000)}
    for secret in (None, "guessed", server.secret + "x"):
        async with TensorStoreClient(server.address, secret=secret) as stranger:
            with pytest.raises(TensorAccessDenied, match="secret"):
                await stranger.put("rollout/job-9", tensors)
            with pytest.raises(TensorAccessDenied):
                await stranger.stat()
    assert server.keys == [] and server.store.reserved_bytes == 0
    ref = server.put_local("k", tensors)
    async with TensorStoreClient(server.address, secret="guessed") as stranger:
        with pytest.raises(TensorAccessDenied):
            await stranger.delete(ref.key)
    assert server.keys == [ref.key]
    async with grpc.aio.insecure_channel(server.address) as channel:  # a foreign client sees the gRPC status
        delete = channel.unary_unary(
            method("Delete"), request_serializer=tensors_pb2.DeleteRequest.SerializeToString
        )
        with pytest.raises(grpc.RpcError) as info:
            await delete(tensors_pb2.DeleteRequest(key=ref.key))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with TensorStoreClient(server.address, secret=server.secret) as owner:
        assert (await owner.stat()).key_count == 1
        assert await owner.delete(ref.key)
    await _round_trip(server)


@pytest.mark.timeout(60)
async def test_keys_are_unpredictable_and_never_overwritten(server: TensorStoreServer) -> None:
    first = server.put_local("weights/v1/0", {"w": torch.ones(4)})
    second = server.put_local("weights/v1/0", {"w": torch.zeros(4)})
    assert first.key != second.key and first.key.startswith("weights/v1/0.")
    assert len(first.key) - len("weights/v1/0.") >= 16
    with pytest.raises(KeyExists):
        server.store.put(first.key, {"w": torch.full((4,), 7.0)})
    async with TensorStoreClient(server.address, secret=server.secret) as owner:
        sent = await owner.put("weights/v1/0", {"w": torch.full((4,), 9.0)})
        assert sent.key not in (first.key, second.key) and sent.capability
        assert torch.equal((await owner.fetch(first))["w"], torch.ones(4))
        assert torch.equal((await owner.fetch(sent))["w"], torch.full((4,), 9.0))


@pytest.mark.timeout(60)
async def test_chunks_under_the_minimum_are_refused(server: TensorStoreServer) -> None:
    tensors = {"t": torch.zeros(64 * KB, dtype=torch.uint8)}
    async with TensorStoreClient(server.address, secret=server.secret) as owner:
        with pytest.raises(MalformedChunk, match="under this store's minimum of 4096"):
            await owner.put_chunks(split_tensors("tiny", tensors, 100))
        ref = await owner.put_chunks(split_tensors("ok", {"a": torch.zeros(5000, dtype=torch.uint8)}, 4 * KB))
        assert ref.nbytes == 5000  # a tensor's last chunk may be shorter
        get = grpc.aio.insecure_channel(server.address)
        try:
            call = get.unary_stream(
                method("Get"), request_serializer=tensors_pb2.GetRequest.SerializeToString
            )
            request = tensors_pb2.GetRequest(key=ref.key, max_chunk_bytes=1)  # would make 1-byte chunks
            with pytest.raises(grpc.RpcError) as info:
                async for _ in call(request, metadata=bearer_metadata(server.secret)):
                    pass
        finally:
            await get.close()
    error = error_from_rpc(info.value, server.address)
    assert isinstance(error, MessageTooLarge) and error.size == 4096
    assert server.store.reserved_bytes == 0
    await _round_trip(server)


async def _stalled_put(server: TensorStoreServer, channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryCall:
    """An owner's Put that sends one chunk and then nothing."""
    call = channel.stream_unary(method("Put"))(metadata=bearer_metadata(server.secret))
    first = next(split_tensors("stall", {"t": torch.zeros(256 * KB, dtype=torch.uint8)}, 64 * KB))
    await call.write(encode_chunk(first))
    return call


@pytest.mark.timeout(60)
async def test_a_stalled_put_is_cut_off_and_others_are_served(server: TensorStoreServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = await _stalled_put(server, channel)
        await _round_trip(server)  # served while the stalled stream is open
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            await call
        assert time.monotonic() - t0 < 5
    error = error_from_rpc(info.value, server.address, tuple(await call.initial_metadata() or ()))
    assert isinstance(error, StreamTruncated) and "stalled" in str(error)
    assert server.store.reserved_bytes == 0 and server.keys == []
    await _round_trip(server)


@pytest.mark.timeout(60)
async def test_concurrent_rpcs_are_capped(server: TensorStoreServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stalled = [await _stalled_put(server, channel) for _ in range(3)]  # the cap is 3
        await asyncio.sleep(0.1)
        async with TensorStoreClient(server.address) as reader:
            with pytest.raises(TensorStoreBusy, match="busy"):
                await reader.fetch(server.put_local("k", {"x": torch.ones(2)}))
        for call in stalled:  # the idle timeout frees the slots
            with pytest.raises(grpc.RpcError):
                await call
    await _round_trip(server)


async def _never_answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await asyncio.sleep(30)
    return b""


@pytest.mark.timeout(60)
async def test_every_client_call_has_a_deadline() -> None:
    """A server that accepts calls and never answers: each client call ends at its deadline."""
    silent = grpc.aio.server()
    handlers = {name: grpc.unary_unary_rpc_method_handler(_never_answer) for name in ("Stat", "Delete")} | {
        "Get": grpc.unary_stream_rpc_method_handler(_stream_nothing)
    }
    silent.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = silent.add_insecure_port("127.0.0.1:0")
    await silent.start()
    try:
        async with TensorStoreClient(f"127.0.0.1:{port}", timeout_s=0.5, secret="s") as client:
            ref = TensorRef(address=client.address, key="k", capability="c" * 64)
            for name, call in (
                ("Get", client.fetch(ref)),
                ("Delete", client.delete(ref)),
                ("Stat", client.stat()),
                ("Stat", client.put("k", {"x": torch.ones(2)})),  # a put asks the limit first
            ):
                t0 = time.monotonic()
                with pytest.raises(TensorStoreTimeout, match=f"{name} at .* 0.5s deadline"):
                    await call
                assert time.monotonic() - t0 < 3
    finally:
        await silent.stop(None)


async def _stream_nothing(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    await asyncio.sleep(30)
    yield b""


@pytest.mark.timeout(60)
async def test_binds_any_host_and_advertises_a_routable_one() -> None:
    srv = TensorStoreServer()
    address = await srv.start(host="0.0.0.0", advertise_host="127.0.0.1")
    try:
        assert address.startswith("127.0.0.1:") and srv.address == address
        ref = srv.put_local("k", {"x": torch.ones(3)})
        assert ref.address == address
        async with TensorStoreClient("localhost:1") as elsewhere:  # reaches the store by the ref's address
            assert torch.equal((await elsewhere.fetch(ref))["x"], torch.ones(3))
    finally:
        await srv.stop(grace=None)
    with pytest.raises(ValueError, match="min_chunk_bytes"):
        TensorStoreServer(min_chunk_bytes=0)
    with pytest.raises(ValueError, match="max_concurrent_rpcs"):
        TensorStoreServer(max_concurrent_rpcs=0)
