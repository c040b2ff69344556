"""TensorStore over real gRPC (a grpc.aio server on port 0): round trips, limits, and bad clients.

After every bad input the server must answer the next request with a consistent store: nothing
half-stored, no reservation left behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from rlfleet.common.errors import (
    ChecksumMismatch,
    MalformedChunk,
    MessageTooLarge,
    StoreFull,
    StreamTruncated,
    TensorStoreUnavailable,
    TransportClosed,
    UnknownDtype,
    UnknownKey,
    UnknownTensor,
)
from rlfleet.common.tensors._gen import tensors_pb2, tensors_pb2_grpc
from rlfleet.common.tensors.codec import (
    chunk_to_proto,
    decode_chunk,
    encode_chunk,
    split_tensors,
    tensor_to_bytes,
)
from rlfleet.common.tensors.guard import bearer_metadata, capability_metadata
from rlfleet.common.tensors.rpc import error_from_rpc, method
from rlfleet.common.tensors.store import TensorStoreClient, TensorStoreServer

MB = 1 << 20


@pytest.fixture
async def server() -> AsyncIterator[TensorStoreServer]:
    srv = TensorStoreServer(capacity_bytes=64 * MB, ttl_s=600.0, chunk_bytes=MB, max_message_bytes=4 * MB)
    await srv.start()
    yield srv
    await srv.stop(grace=None)


@pytest.fixture
async def client(server: TensorStoreServer) -> AsyncIterator[TensorStoreClient]:
    cli = TensorStoreClient(server.address, chunk_bytes=MB, max_message_bytes=4 * MB, secret=server.secret)
    yield cli
    await cli.close()


def _payload() -> dict[str, torch.Tensor]:
    """About 20 MB of mixed dtypes and shapes, edge cases included."""
    gen = torch.Generator().manual_seed(0)
    return {
        "w_bf16": torch.randn(2048, 2048, generator=gen).bfloat16(),  # 8 MiB
        "w_f32": torch.randn(1536, 1536, generator=gen),  # 9 MiB
        "ids": torch.randint(0, 50_000, (4096, 64), generator=gen),  # 2 MiB
        "mask": torch.rand(999, generator=gen) > 0.5,
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 7),
        "f8": torch.randn(300, generator=gen).to(torch.float8_e4m3fn),
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert tensor_to_bytes(got[name]) == tensor_to_bytes(tensor), name


async def _consistent(server: TensorStoreServer, client: TensorStoreClient, keys: list[str]) -> None:
    """The store holds exactly ``keys``, nothing is left reserved, and it still serves a round trip."""
    for _ in range(100):  # a cancelled put is cleaned up by its handler a moment later
        if server.store.reserved_bytes == 0:
            break
        await asyncio.sleep(0.02)
    assert server.store.reserved_bytes == 0
    assert sorted(k.rsplit(".", 1)[0] for k in server.keys) == sorted(keys)  # keys carry a random suffix
    probe = {"p": torch.arange(1000)}
    ref = await client.put("probe", probe)
    _assert_same(await client.fetch(ref), probe)
    assert await client.delete(ref)


@pytest.mark.timeout(60)
async def test_put_get_round_trip(server: TensorStoreServer, client: TensorStoreClient) -> None:
    payload = _payload()
    ref = await client.put("batch/1", payload)
    nbytes = sum(t.numel() * t.element_size() for t in payload.values())
    assert (ref.address, ref.nbytes) == (server.address, nbytes)
    assert ref.key.startswith("batch/1.") and len(ref.key) > len("batch/1.") + 10  # a random suffix
    assert server.used_bytes == nbytes
    _assert_same(await client.get(ref.key), payload)
    _assert_same(await client.fetch(ref), payload)
    stat = await client.stat(ref.key)
    assert [t.name for t in stat.tensors] == list(payload)
    assert stat.used_bytes == nbytes and stat.key_count == 1 and 590 < (stat.expires_in_s or 0) <= 600


@pytest.mark.timeout(60)
async def test_names_filter(server: TensorStoreServer, client: TensorStoreClient) -> None:
    payload = _payload()
    ref = await client.put("k", payload)
    got = await client.get(ref.key, names=["scalar", "ids"])
    _assert_same(got, {"scalar": payload["scalar"], "ids": payload["ids"]})
    with pytest.raises(UnknownTensor, match="no tensor named 'nope'"):
        await client.get(ref.key, names=["ids", "nope"])
    await _consistent(server, client, ["k"])


@pytest.mark.timeout(60)
async def test_put_local_and_fetch_from_another_store(server: TensorStoreServer) -> None:
    other = TensorStoreServer()
    await other.start()
    try:
        ref = other.put_local("weights/v1", {"w": torch.ones(3, 3)})
        assert ref.address == other.address
        assert torch.equal(other.get_local(ref.key)["w"], torch.ones(3, 3))
        async with TensorStoreClient(server.address) as cli:
            got = await cli.fetch(ref)  # a ref into another server: a channel there, the ref's capability
        assert torch.equal(got["w"], torch.ones(3, 3))
    finally:
        await other.stop(grace=None)


@pytest.mark.timeout(60)
async def test_unknown_key_and_delete(server: TensorStoreServer, client: TensorStoreClient) -> None:
    with pytest.raises(UnknownKey) as info:
        await client.get("never-put")
    assert info.value.key == "never-put" and info.value.address == server.address
    with pytest.raises(UnknownKey):
        await client.stat("never-put")
    ref = await client.put("k", {"x": torch.zeros(4)})
    assert await client.delete(ref.key) is True
    assert await client.delete(ref.key) is False
    with pytest.raises(UnknownKey):
        await client.get(ref.key)
    await _consistent(server, client, [])


@pytest.mark.timeout(60)
async def test_ttl_expiry() -> None:
    srv = TensorStoreServer(ttl_s=0.3)
    await srv.start()
    try:
        async with TensorStoreClient(srv.address, secret=srv.secret) as cli:
            ref = await cli.put("k", {"x": torch.zeros(1000)})
            assert (await cli.fetch(ref))["x"].numel() == 1000
            await asyncio.sleep(0.6)
            assert srv.used_bytes == 0 and srv.keys == []  # the sweeper freed it
            with pytest.raises(UnknownKey):
                await cli.fetch(ref)
    finally:
        await srv.stop(grace=None)


@pytest.mark.timeout(60)
async def test_store_full_leaves_the_store_unchanged(
    server: TensorStoreServer, client: TensorStoreClient
) -> None:
    await client.put("small", {"x": torch.zeros(MB // 4)})  # 1 MiB
    big = {"a": torch.zeros(16 * MB // 4), "b": torch.zeros(16 * MB // 4), "c": torch.zeros(40 * MB // 4)}
    with pytest.raises(StoreFull) as info:
        await client.put("big", big)
    assert info.value.capacity == 64 * MB and info.value.used == MB
    assert "delete consumed keys" in str(info.value)
    assert server.used_bytes == MB
    await _consistent(server, client, ["small"])


@pytest.mark.timeout(60)
async def test_unknown_dtype_is_refused_before_sending(
    server: TensorStoreServer, client: TensorStoreClient
) -> None:
    with pytest.raises(UnknownDtype):
        await client.put("k", {"ok": torch.zeros(2), "c": torch.zeros(2, dtype=torch.complex64)})
    await _consistent(server, client, [])


def _chunks(key: str = "bad") -> list:
    return list(
        split_tensors(key, {"a": torch.arange(3 * MB // 8, dtype=torch.int64), "b": torch.ones(10)}, MB)
    )


@pytest.mark.timeout(60)
async def test_corrupt_chunk_gets_checksum_mismatch(
    server: TensorStoreServer, client: TensorStoreClient
) -> None:
    await client.put("keep", {"x": torch.ones(10)})
    chunks = _chunks()
    damaged = bytearray(chunks[1].data)
    damaged[123] ^= 0x40
    chunks[1] = dataclasses.replace(chunks[1], data=bytes(damaged))
    with pytest.raises(ChecksumMismatch) as info:
        await client.put_chunks(chunks)
    assert info.value.name == "a"
    await _consistent(server, client, ["keep"])


@pytest.mark.timeout(60)
async def test_stream_without_end_marker_is_truncated(
    server: TensorStoreServer, client: TensorStoreClient
) -> None:
    chunks = _chunks()
    with pytest.raises(StreamTruncated, match="no end-of-stream marker"):
        await client.put_chunks(chunks[:-1])
    with pytest.raises(StreamTruncated, match="'a' at 1048576 of 3145728"):
        await client.put_chunks(chunks[:1])
    await _consistent(server, client, [])


@pytest.mark.timeout(60)
async def test_client_cut_off_mid_stream(server: TensorStoreServer, client: TensorStoreClient) -> None:
    chunks = _chunks()
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = channel.stream_unary(method("Put"))(metadata=bearer_metadata(server.secret))
        for chunk in chunks[:2]:
            await call.write(encode_chunk(chunk))
        await asyncio.sleep(0.1)
        assert server.store.reserved_bytes > 0  # the server holds room for the put in flight
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    await _consistent(server, client, [])


async def _raw_put(address: str, messages: list[bytes], secret: str) -> Exception:
    """Send raw Put messages the way a foreign client might; the mapped error it gets back."""
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 * MB)]
    ) as channel:
        put = channel.stream_unary(method("Put"))
        with pytest.raises(grpc.RpcError) as info:
            await put(iter(messages), metadata=bearer_metadata(secret))
    return error_from_rpc(info.value, address)


@pytest.mark.timeout(60)
async def test_oversized_chunks_get_message_too_large(
    server: TensorStoreServer, client: TensorStoreClient
) -> None:
    slightly = split_tensors("k", {"t": torch.zeros(4 * MB + 100, dtype=torch.uint8)}, 4 * MB + 100)
    error = await _raw_put(server.address, [encode_chunk(next(slightly))], server.secret)
    assert isinstance(error, MessageTooLarge)  # found by the server's own check, fields intact
    assert (error.size, error.limit, error.what) == (4 * MB + 100, 4 * MB, "tensor chunk")
    far = split_tensors("k", {"t": torch.zeros(8 * MB, dtype=torch.uint8)}, 8 * MB)
    error = await _raw_put(server.address, [encode_chunk(next(far))], server.secret)
    assert isinstance(error, MessageTooLarge) and error.size > 8 * MB  # refused by gRPC itself
    await _consistent(server, client, [])


@pytest.mark.timeout(60)
async def test_clients_and_servers_with_other_limits_agree(server: TensorStoreServer) -> None:
    tensors = {"t": torch.randn(3 * MB)}  # 12 MiB
    async with TensorStoreClient(
        server.address, chunk_bytes=8 * MB, max_message_bytes=16 * MB, secret=server.secret
    ) as big:
        ref = await big.put("k", tensors)  # chunks shrink to the server's 4 MiB limit
        _assert_same(await big.fetch(ref), tensors)
        with pytest.raises(MessageTooLarge, match="tensor chunk of 8388608 bytes"):
            await big.put_chunks(split_tensors("other", tensors, 8 * MB))  # refused before sending
    async with TensorStoreClient(
        server.address, chunk_bytes=64 * 1024, max_message_bytes=256 * 1024, secret=server.secret
    ) as small:
        _assert_same(await small.fetch(ref), tensors)  # the server sends chunks the client accepts
        await _consistent(server, small, ["k"])


@pytest.mark.timeout(60)
async def test_garbage_bytes_get_malformed_chunk(
    server: TensorStoreServer, client: TensorStoreClient
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        put = channel.stream_unary(method("Put"))
        with pytest.raises(grpc.RpcError) as info:
            await put(iter([b"\x0b\xff\xff"]), metadata=bearer_metadata(server.secret))
    error = error_from_rpc(info.value, server.address)
    assert isinstance(error, MalformedChunk)
    await _consistent(server, client, [])


@pytest.mark.timeout(60)
async def test_generated_stub_speaks_the_same_protocol(
    server: TensorStoreServer, client: TensorStoreClient
) -> None:
    tensors = {"w": torch.randn(300, 300).bfloat16(), "n": torch.tensor([1, 2, 3])}
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = tensors_pb2_grpc.TensorStoreStub(channel)
        messages = [chunk_to_proto(c) for c in split_tensors("stub", tensors, 64 * 1024)]
        owner = bearer_metadata(server.secret)
        summary = await stub.Put(iter(messages), metadata=owner)
        assert summary.key.startswith("stub.") and summary.tensor_count == 2
        request = tensors_pb2.GetRequest(key=summary.key, names=["n"])
        replies = [
            m
            async for m in stub.Get(
                request, metadata=capability_metadata(server.guard.capability(summary.key))
            )
        ]
        assert replies[-1].end_of_stream and replies[-1].tensor_count == 1
        assert replies[0].dtype == "I64" and list(replies[0].shape) == [3] and replies[0].HasField("crc32")
        stat = await stub.Stat(tensors_pb2.StatRequest(key=summary.key), metadata=owner)
        assert [t.name for t in stat.tensors] == ["w", "n"]
    _assert_same(await client.get(summary.key), tensors)
    assert decode_chunk(replies[0].SerializeToString()).name == "n"


@pytest.mark.timeout(60)
async def test_unreachable_and_closed_clients() -> None:
    srv = TensorStoreServer()
    address = await srv.start()
    await srv.stop(grace=None)
    async with TensorStoreClient(address) as cli:
        with pytest.raises(TensorStoreUnavailable):
            await cli.get("k")
    with pytest.raises(TransportClosed):
        await cli.get("k")
