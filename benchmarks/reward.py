"""Reward service throughput and latency: 1, 4 and 16 concurrent clients against one reward server.

    uv run python benchmarks/reward.py                   # rule and MiniLM endpoints, ~2 minutes
    uv run python benchmarks/reward.py --seconds 3 --samples 16
    uv run python benchmarks/reward.py --smoke           # both endpoints, 1 client, 0.5 s (CI's check)

A real setup on one machine: a nats-server, ``rlfleet-reward serve`` as its own process with a
tenant (token checked on every request) and two endpoints, ``rule`` (``0.7*concise + 0.3*relevance``)
and ``minilm`` (``similarity``, all-MiniLM-L6-v2 on the CPU), and a TensorStore in this process
holding one rollout batch of ``--samples`` samples (texts of 20-60 words). Each client sends score
requests one after another for ``--seconds`` (after a warm-up); the clients run concurrently on one
NATS connection. Reported per endpoint and client count: requests, samples/s, and p50/p99 latency of
a request (ScoreRequest out to ScoreResult back: NATS both ways, the server's gRPC fetch of the
texts, scoring). Results go to benchmarks/results/reward.json and a table is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import smoke
import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.messages import ScoreRequest, ScoreResult
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject
from rlfleet.common.schema.batch import RolloutBatch
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors.store import TensorStoreServer

RESULTS = Path(__file__).parent / "results" / "reward.json"
CLUSTER = "bench"
TOKEN = "benchmark-tenant-token"
ENDPOINTS = {
    "rule": "0.7*concise:max_words=50 + 0.3*relevance",
    "minilm": "similarity:key=reference,device=cpu",
}
WORDS = ("the model answers each question with a short explanation of the steps it took to reach the final "
         "number and checks units carefully before writing the result down clearly").split()  # fmt: skip


def rollout(samples: int, seed: int = 0) -> RolloutBatch:
    """``samples`` responses of 20-60 words to samples/4 prompts (GRPO groups of 4)."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(20, 60))) for _ in range(samples)]
    prompts = [f"question {i // 4}: explain {rng.choice(WORDS)}" for i in range(samples)]
    return RolloutBatch.from_rows(prompts=[[1]] * samples, responses=[[2]] * samples,
                                  logprobs=[[0.0]] * samples, group_index=[i // 4 for i in range(samples)],
                                  pad_id=0, prompt_text=prompts, response_text=texts)  # fmt: skip


def server_config(nats_url: str) -> dict[str, Any]:
    return {"nats_url": nats_url, "cluster": CLUSTER, "worker_id": "reward-bench", "max_concurrency": 16,
            "log_level": "WARNING", "endpoints": ENDPOINTS,
            "tenants": [{"name": "bench", "token": TOKEN, "endpoints": list(ENDPOINTS)}]}  # fmt: skip


async def client_loop(
    transport: NatsTransport, request: ScoreRequest, until: float, out: list[float]
) -> None:
    verb = subject(CLUSTER, "reward", "score")
    while time.perf_counter() < until:
        start = time.perf_counter()
        reply = await transport.request(verb, request, timeout=120, tier="reward")
        assert isinstance(reply, ScoreResult), reply
        out.append(time.perf_counter() - start)


async def measure(transport: NatsTransport, request: ScoreRequest, clients: int, seconds: float,
                  samples: int) -> dict[str, float]:  # fmt: skip
    await client_loop(transport, request, time.perf_counter() + min(2.0, seconds / 3), [])  # warm-up
    latencies: list[float] = []
    start = time.perf_counter()
    until = start + seconds
    await asyncio.gather(*(client_loop(transport, request, until, latencies) for _ in range(clients)))
    elapsed = time.perf_counter() - start
    ordered = sorted(latencies)
    return {
        "clients": clients, "requests": len(latencies), "samples_per_request": samples,
        "samples_per_s": len(latencies) * samples / elapsed, "requests_per_s": len(latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }  # fmt: skip


async def bench(nats_url: str, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    store = TensorStoreServer()
    await store.start()
    ref: TensorRef = store.put_local("bench-batch", rollout(args.samples).to_tensors())
    transport = await NatsTransport.connect(nats_url, name="reward-bench", tier="controller")
    registry = WorkerRegistry(transport, CLUSTER)
    await registry.start()
    try:
        await registry.wait_for("reward", 1, timeout=180)
        results: dict[str, list[dict[str, float]]] = {}
        for endpoint in args.endpoints:
            request = ScoreRequest(
                job_id="bench",
                endpoint=endpoint,
                rollout=ref,
                token=TOKEN,
                metadata=[{"reference": "the final number is checked"}] * (args.samples // 4),
            )
            results[endpoint] = []
            for clients in args.clients:
                row = await measure(transport, request, clients, args.seconds, args.samples)
                results[endpoint].append(row)
                print(f"  {endpoint:>7} x{clients:<3} {row['samples_per_s']:9.1f} samples/s", flush=True)
        return results
    finally:
        await registry.stop()
        await transport.close()
        await store.stop()


def report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    print(f"\n{'endpoint':<9}{'clients':>8}{'requests':>10}{'samples/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    for endpoint, rows in results.items():
        for row in rows:
            print(f"{endpoint:<9}{row['clients']:>8}{row['requests']:>10}{row['samples_per_s']:>12.1f}"
                  f"{row['p50_ms']:>10.1f}{row['p99_ms']:>10.1f}")  # fmt: skip
    data = {
        "benchmark": "reward service: concurrent clients against one rlfleet-reward server",
        "endpoints": {name: ENDPOINTS[name] for name in results},
        "samples_per_request": args.samples, "seconds_per_point": args.seconds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "load_avg_1m_at_end": os.getloadavg()[0]},
        "results": results,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwritten to {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per point")
    parser.add_argument("--samples", type=int, default=32, help="samples per score request (multiple of 4)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients")
    parser.add_argument("--endpoints", nargs="+", default=list(ENDPOINTS), choices=list(ENDPOINTS))
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON results")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = smoke.parse(parser, None, {"seconds": 0.5, "samples": 4, "clients": [1]})
    script = Path(sys.executable).parent / "rlfleet-reward"
    with EmbeddedNats() as nats, tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "reward.yaml"
        config.write_text(yaml.safe_dump(server_config(nats.url)))
        server = subprocess.Popen([str(script), "serve", "--config", str(config)])
        try:
            results = asyncio.run(bench(nats.url, args))
        finally:
            server.terminate()
            server.wait(timeout=30)
    report(results, args)


if __name__ == "__main__":
    main()
