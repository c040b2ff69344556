"""Tensor-plane throughput: a dict of tensors between two processes over loopback, through the
TensorStore gRPC service and over a plain TCP socket, in the same run.

    uv run python benchmarks/tensor_stream.py                # 512 MiB, bf16 + fp32 tensors
    uv run python benchmarks/tensor_stream.py --mb 128 --reps 3
    uv run python benchmarks/tensor_stream.py --smoke        # 64 MiB, one timed round (CI's check)

A producer process holds the payload in a TensorStoreServer (``put_local``) and also serves the
same bytes on a raw TCP socket. The consumer (this process) takes turns: ``TensorStoreClient.get``
(gRPC, chunked, crc32-checked) and a raw ``recv_into`` of each tensor into a fresh tensor, the
best a Python socket can do. It also times the other direction (``put`` against a raw upload).
Each figure is the median over ``--reps`` rounds, after one warm-up round; the rounds interleave
so that load from other processes hits both paths alike. Results go to
benchmarks/results/tensor_stream.json; benchmarks/README.md explains them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeVar

import smoke
import torch

from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors.codec import DTYPES, dtype_name, empty_bytes, tensor_buffer
from rlfleet.common.tensors.store import TensorStoreClient, TensorStoreServer

logger = logging.getLogger(__name__)

KEY = "payload"
TENSOR_MB = 16
RESULTS = Path(__file__).parent / "results" / "tensor_stream.json"
T = TypeVar("T")


def make_payload(mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``mb`` MiB of tensors of 16 MiB, bf16 and fp32 in turn, plus a few small ones."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {
        "scalar": torch.tensor(1.5),
        "bias": torch.randn(4096, generator=gen).bfloat16(),
        "mask": torch.rand(1000, generator=gen) > 0.5,
    }
    budget = (mb << 20) - sum(t.numel() * t.element_size() for t in tensors.values())
    index = 0
    while budget > 0:
        dtype = torch.bfloat16 if index % 2 == 0 else torch.float32
        nbytes = min(TENSOR_MB << 20, budget)
        numel = max(nbytes // dtype.itemsize, 1)
        tensor = torch.randn(numel, generator=gen).to(dtype)
        tensors[f"layers.{index}.weight"] = tensor.reshape(-1, 256) if numel % 256 == 0 else tensor
        budget -= numel * dtype.itemsize
        index += 1
    return tensors


def payload_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def crcs(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: zlib.crc32(tensor_buffer(t)) for name, t in tensors.items()}


# --- raw TCP: a JSON header line per tensor, then its bytes -----------------------------------


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("raw peer closed mid-tensor")
        got += n


def raw_send(sock: socket.socket, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        buf = tensor_buffer(tensor)
        head = json.dumps({"name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)})
        sock.sendall(struct.pack("<IQ", len(head), len(buf)) + head.encode())
        sock.sendall(buf)
    sock.sendall(struct.pack("<IQ", 0, 0))


def raw_recv(sock: socket.socket) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    while True:
        fixed = bytearray(12)
        _recv_exact(sock, memoryview(fixed))
        head_len, nbytes = struct.unpack("<IQ", fixed)
        if head_len == 0:
            return out
        head_raw = bytearray(head_len)
        _recv_exact(sock, memoryview(head_raw))
        head = json.loads(head_raw)
        data = empty_bytes(nbytes)  # the same allocator as the TensorStore client: a fair race
        _recv_exact(sock, memoryview(data.numpy()))
        out[head["name"]] = data.view(DTYPES[head["dtype"]]).reshape(head["shape"])


def _raw_server(listener: socket.socket, tensors: dict[str, torch.Tensor]) -> None:
    while True:
        conn, _ = listener.accept()
        with conn:
            command = conn.recv(1)
            if command == b"G":
                raw_send(conn, tensors)
            elif command == b"P":
                raw_recv(conn)
                conn.sendall(b"k")
            else:
                return


# --- the producer process ----------------------------------------------------------------------


def producer(mb: int, chunk_bytes: int, conn: Connection) -> None:
    tensors = make_payload(mb)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_server, args=(listener, tensors), daemon=True).start()
    asyncio.run(_produce(tensors, chunk_bytes, conn, listener.getsockname()[1]))


async def _produce(
    tensors: dict[str, torch.Tensor], chunk_bytes: int, conn: Connection, raw_port: int
) -> None:
    server = TensorStoreServer(capacity_bytes=8 << 30, ttl_s=3600.0, chunk_bytes=chunk_bytes)
    address = await server.start()
    ref = server.put_local(KEY, tensors)
    conn.send(
        {
            "address": address,
            "key": ref.key,  # KEY plus the store's random suffix
            "secret": server.secret,  # the consumer gets, puts and deletes as the store's owner
            "raw_port": raw_port,
            "crcs": crcs(tensors),
            "nbytes": payload_bytes(tensors),
            "pid": os.getpid(),
        }
    )
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, conn.recv)  # the consumer says when it is done
    await server.stop()


# --- the consumer's timed rounds ---------------------------------------------------------------


def _raw_get(port: int) -> dict[str, torch.Tensor]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"G")
        return raw_recv(sock)


def _raw_put(port: int, tensors: dict[str, torch.Tensor]) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"P")
        raw_send(sock, tensors)
        if sock.recv(1) != b"k":
            raise ConnectionError("raw upload not acknowledged")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used, all its threads together."""
    if pid == os.getpid():
        times = os.times()
        return times.user + times.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CPU: dict[str, list[float]] = {}


async def _timed(name: str, coro_fn, nbytes: int, peer: int) -> float:  # type: ignore[no-untyped-def]
    cpu0 = (_cpu_s(os.getpid()), _cpu_s(peer))
    start = time.perf_counter()
    result = await coro_fn()
    elapsed = time.perf_counter() - start
    cpu1 = (_cpu_s(os.getpid()), _cpu_s(peer))
    del result
    gib = nbytes / 2**30
    CPU.setdefault(name, []).append(((cpu1[0] - cpu0[0]) / gib, (cpu1[1] - cpu0[1]) / gib))
    return nbytes / elapsed / 2**20


async def consume(info: dict, mb: int, reps: int, chunk_bytes: int, with_put: bool) -> dict[str, list[float]]:
    expected = info["crcs"]
    upload = make_payload(mb, seed=1) if with_put else {}
    nbytes = info["nbytes"]
    client = TensorStoreClient(info["address"], secret=info["secret"], chunk_bytes=chunk_bytes)
    port = info["raw_port"]
    peer = info["pid"]
    key = info["key"]
    got = await client.get(key)
    raw = await asyncio.to_thread(_raw_get, port)
    if crcs(got) != expected or crcs(raw) != expected:
        raise AssertionError("payload damaged in transit")
    del got, raw
    rounds: dict[str, list[float]] = {"grpc_get": [], "raw_get": [], "grpc_put": [], "raw_put": []}
    for rep in range(reps + 1):
        sample = {
            "grpc_get": await _timed("grpc_get", lambda: client.get(key), nbytes, peer),
            "raw_get": await _timed("raw_get", lambda: asyncio.to_thread(_raw_get, port), nbytes, peer),
        }
        if with_put:
            stored: list[TensorRef] = []
            sample["grpc_put"] = await _timed("grpc_put", lambda: _put(client, upload, stored), nbytes, peer)  # noqa: B023
            await client.delete(stored.pop())
            sample["raw_put"] = await _timed(
                "raw_put", lambda: asyncio.to_thread(_raw_put, port, upload), nbytes, peer
            )
        if rep > 0:  # round 0 warms up
            for name, value in sample.items():
                rounds[name].append(value)
        print(f"round {rep}: " + "  ".join(f"{k} {v:7.0f} MB/s" for k, v in sample.items()), flush=True)
    await client.close()
    return rounds


async def _put(client: TensorStoreClient, tensors: dict[str, torch.Tensor], stored: list[TensorRef]) -> None:
    """``client.put``, keeping the ref (the stored key has a random suffix) to delete it by."""
    stored.append(await client.put("upload", tensors))


def with_producer(target: Callable[..., None], args: tuple, consume: Callable[[dict], Awaitable[T]]) -> T:
    """Start ``target(*args, conn)`` in a spawned process, run ``consume`` on the first thing it sends
    (in an event loop of this process), then tell it to stop (the producer waits on ``conn.recv``)."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, theirs), daemon=True)
    proc.start()
    try:
        return asyncio.run(consume(ours.recv()))
    finally:
        ours.send("done")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=512, help="payload size in MiB")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument(
        "--chunk-mb", type=float, default=None, help="chunk payload in MiB (default: library's)"
    )
    parser.add_argument("--no-put", action="store_true", help="time only the get direction")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON results")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = smoke.parse(parser, None, {"mb": 64, "reps": 1})  # 64: enough CPU ticks to divide by
    logging.basicConfig(level=logging.WARNING)
    from rlfleet.common.tensors.codec import DEFAULT_CHUNK_BYTES

    chunk_bytes = int(args.chunk_mb * 2**20) if args.chunk_mb else DEFAULT_CHUNK_BYTES
    load = [os.getloadavg()[0]]
    rounds = with_producer(
        producer,
        (args.mb, chunk_bytes),
        lambda info: consume(info, args.mb, args.reps, chunk_bytes, not args.no_put),
    )
    load.append(os.getloadavg()[0])
    result = summarize(rounds, args, chunk_bytes, load)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _cpu_ratio(cpu: dict[str, list[float]], grpc_name: str, raw_name: str) -> float | None:
    """Bytes per CPU-second of gRPC relative to raw TCP, both processes counted."""
    if grpc_name not in cpu or raw_name not in cpu:
        return None
    return round(sum(cpu[raw_name]) / sum(cpu[grpc_name]), 3)


def summarize(
    rounds: dict[str, list[float]], args: argparse.Namespace, chunk_bytes: int, load: list[float]
) -> dict:
    """The JSON results: medians, ratios, per-round figures and CPU cost per GiB."""
    med = {name: statistics.median(v) for name, v in rounds.items() if v}
    # CPU seconds per GiB moved, [client process, server process], all threads; sample 0 is warm-up
    cpu = {
        k: [
            round(statistics.median(x[0] for x in v[1:]), 3),
            round(statistics.median(x[1] for x in v[1:]), 3),
        ]
        for k, v in CPU.items()
    }
    put = "grpc_put" in med
    return {
        "payload_mb": args.mb,
        "chunk_mb": chunk_bytes / 2**20,
        "reps": args.reps,
        "grpc_mb_s": round(med["grpc_get"], 1),
        "raw_tcp_mb_s": round(med["raw_get"], 1),
        "ratio": round(med["grpc_get"] / med["raw_get"], 3),
        "grpc_put_mb_s": round(med["grpc_put"], 1) if put else None,
        "raw_tcp_put_mb_s": round(med["raw_put"], 1) if put else None,
        "put_ratio": round(med["grpc_put"] / med["raw_put"], 3) if put else None,
        "cpu_s_per_gib": cpu,
        # bytes moved per CPU-second (both processes), gRPC relative to raw TCP: what the ratio
        # tends to when the cores are the bottleneck, as they are on a busy 2-core machine
        "cpu_ratio": _cpu_ratio(cpu, "grpc_get", "raw_get"),
        "cpu_put_ratio": _cpu_ratio(cpu, "grpc_put", "raw_put"),
        "rounds_mb_s": {k: [round(x, 1) for x in v] for k, v in rounds.items() if v},
        # 1-minute load average before and after: above the CPU count, other processes competed
        # for the cores and the MB/s figures say as much about them as about the two paths
        "load_avg_1m": [round(x, 2) for x in load],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "unix_time": int(time.time()),
    }


def print_table(result: dict) -> None:
    size = f"payload {result['payload_mb']} MiB, chunk {result['chunk_mb']:g} MiB"
    print(f"\n{size}, median of {result['reps']} rounds")
    print(f"{'path':<28}{'MB/s':>10}{'vs raw TCP':>12}")
    print(f"{'gRPC TensorStore get':<28}{result['grpc_mb_s']:>10.0f}{result['ratio']:>12.2f}")
    print(f"{'raw TCP socket (get)':<28}{result['raw_tcp_mb_s']:>10.0f}{1.0:>12.2f}")
    if result["grpc_put_mb_s"] is not None:
        print(f"{'gRPC TensorStore put':<28}{result['grpc_put_mb_s']:>10.0f}{result['put_ratio']:>12.2f}")
        print(f"{'raw TCP socket (put)':<28}{result['raw_tcp_put_mb_s']:>10.0f}{1.0:>12.2f}")
    for name, (client, server) in result["cpu_s_per_gib"].items():
        print(f"CPU s/GiB {name:<10} client process {client:.2f}  server process {server:.2f}")
    print(f"bytes per CPU-second, gRPC / raw TCP: get {result['cpu_ratio']}, put {result['cpu_put_ratio']}")
    cpus = result["machine"]["cpus"] or 1
    if max(result["load_avg_1m"]) > cpus:
        load = max(result["load_avg_1m"])
        print(f"warning: load average {load} on {cpus} CPUs: other processes shared the cores")


if __name__ == "__main__":
    main()
