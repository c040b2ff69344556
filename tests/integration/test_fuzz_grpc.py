"""Fuzz the tensor plane: malformed streams to a real TensorStore gRPC server.

Garbage bytes, wrong chunk order, wrong dtype and shape headers, oversized declared sizes, bad
checksums, mixed keys, chunks after the end marker and streams cut off before it, sent with the
store's secret (so that they reach the parsing) and without it. Each call must end with an error
status (never OK, never a hang past its deadline), and the server keeps serving: a valid put and
get work afterwards and no reservation is left behind.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import torch

from rlfleet.common.tensors._gen import tensors_pb2 as pb
from rlfleet.common.tensors.guard import bearer_metadata
from rlfleet.common.tensors.rpc import method
from rlfleet.common.tensors.store import TensorStoreClient, TensorStoreServer

pytestmark = pytest.mark.timeout(180)

CALL_DEADLINE = 15.0
CASES_PER_KIND = 25
KB = 1 << 10


def _chunk(**fields: object) -> bytes:
    base: dict[str, object] = {"key": "fuzz/a", "name": "t", "dtype": "F32", "shape": [2048],
                               "offset": 0, "total_bytes": 8192, "data": bytes(8192)}  # fmt: skip
    base.update(fields)
    return pb.TensorChunk(**base).SerializeToString()  # type: ignore[arg-type]


def _end(count: int = 1) -> bytes:
    return pb.TensorChunk(end_of_stream=True, tensor_count=count).SerializeToString()


Stream = list[bytes]
KINDS: dict[str, Callable[[random.Random], Stream]] = {
    "garbage bytes": lambda r: [bytes(r.getrandbits(8) for _ in range(r.randint(1, 300)))],
    "garbage after a chunk": lambda r: [_chunk(), b"\xff" * r.randint(1, 50)],
    "unknown dtype": lambda r: [_chunk(dtype=r.choice(["F99", "", "float32", "I128", "\u00e9"])), _end()],
    "shape and size disagree": lambda r: [_chunk(shape=[r.randint(1, 10**6)]), _end()],
    "negative or huge shape": lambda r: [
        _chunk(shape=[r.choice([-1, -(2**40), 2**62])], total_bytes=8192),
        _end(),
    ],  # fmt: skip
    "oversized declared size": lambda r: [_chunk(shape=[2**40], total_bytes=2**42), _end()],
    "total bytes past 2**63": lambda r: [_chunk(total_bytes=2**64 - r.randint(1, 1000)), _end()],
    "chunks out of order": lambda r: [
        _chunk(shape=[4096], total_bytes=16384, offset=8192),
        _chunk(shape=[4096], total_bytes=16384),
        _end(),
    ],
    "overlapping chunks": lambda r: [
        _chunk(shape=[4096], total_bytes=16384),
        _chunk(shape=[4096], total_bytes=16384),
        _end(),
    ],
    "offset past the end": lambda r: [_chunk(offset=2**50), _end()],
    "bad checksum": lambda r: [_chunk(crc32=r.getrandbits(32) | 1), _end()],
    "keys change mid stream": lambda r: [
        _chunk(shape=[4096], total_bytes=16384),
        _chunk(key="fuzz/b", shape=[4096], total_bytes=16384, offset=8192),
        _end(),
    ],  # fmt: skip
    "wrong tensor count": lambda r: [_chunk(), _end(count=r.choice([0, 2, 2**31]))],
    "chunk after the end": lambda r: [_chunk(), _end(), _chunk(name="u")],
    "truncated (no end marker)": lambda r: [_chunk(shape=[4096], total_bytes=16384)],
    "empty stream": lambda r: [],
    "only an end marker": lambda r: [_end(count=r.randint(0, 3))],
    "tiny middle chunks": lambda r: [_chunk(shape=[2048], total_bytes=8192, data=bytes(16)), _end()],
    "bad key": lambda r: [_chunk(key=r.choice(["", "/" * 300, "a\x00b", "k" * 100_000])), _end()],
}


@pytest.fixture
async def server() -> AsyncIterator[TensorStoreServer]:
    srv = TensorStoreServer(capacity_bytes=64 << 20, ttl_s=600, max_message_bytes=4 << 20, idle_timeout_s=5)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def _put(channel: grpc.aio.Channel, stream: Stream, secret: str) -> grpc.StatusCode:
    call = channel.stream_unary(method("Put"))
    try:
        await call(iter(stream), metadata=bearer_metadata(secret) if secret else None, timeout=CALL_DEADLINE)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


async def _get(channel: grpc.aio.Channel, request: bytes, secret: str) -> grpc.StatusCode:
    call = channel.unary_stream(method("Get"))(
        request, metadata=bearer_metadata(secret) if secret else None, timeout=CALL_DEADLINE
    )
    try:
        async for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


async def test_malformed_streams_get_error_statuses_and_the_server_keeps_serving(
    server: TensorStoreServer,
) -> None:
    rng = random.Random(11)
    options = [("grpc.max_send_message_length", 8 << 20)]
    bad: list[str] = []
    statuses: dict[grpc.StatusCode, int] = {}
    async with grpc.aio.insecure_channel(server.address, options=options) as channel:
        slots = asyncio.Semaphore(16)

        async def one(label: str, call: asyncio.Future[grpc.StatusCode] | object) -> None:
            async with slots:
                status = await call  # type: ignore[misc]
            statuses[status] = statuses.get(status, 0) + 1
            if status in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED):
                bad.append(f"{label}: {status}")

        jobs = []
        for label, make in KINDS.items():
            for i in range(CASES_PER_KIND):
                secret = server.secret if i % 5 else ""  # one in five without the store's secret
                jobs.append(one(f"put {label}", _put(channel, make(rng), secret)))
        for _ in range(CASES_PER_KIND * 4):
            garbage = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
            jobs.append(one("get garbage", _get(channel, garbage, server.secret)))
            missing = pb.GetRequest(key=f"nope/{rng.getrandbits(32)}", max_chunk_bytes=2**63)
            missing = missing.SerializeToString()
            jobs.append(one("get missing key", _get(channel, missing, server.secret)))
        await asyncio.gather(*jobs)
    assert not bad, f"{len(bad)} calls did not fail cleanly, first: {bad[:5]}"
    assert sum(statuses.values()) == len(KINDS) * CASES_PER_KIND + CASES_PER_KIND * 8
    await asyncio.sleep(0.2)
    assert server.store.reserved_bytes == 0  # every refused put gave its room back
    async with TensorStoreClient(server.address, secret=server.secret) as client:
        tensors = {"x": torch.arange(5000, dtype=torch.float32)}
        ref = await client.put("fuzz/ok", tensors)
        assert torch.equal((await client.fetch(ref))["x"], tensors["x"])
