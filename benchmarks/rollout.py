"""Rollout throughput: bare ``vllm.LLM.generate`` against the rlfleet rollout service on the same prompts.

    uv run --extra cpu python benchmarks/rollout.py                      # tiny model, CPU
    uv run --extra cpu python benchmarks/rollout.py --model smollm2 --prompts 16 --max-tokens 64
    uv run --extra gpu python benchmarks/rollout.py --model PATH --device cuda --prompts 256

Bare: ``vllm.LLM`` in this process, built with the settings the rollout worker gives vLLM, one
``generate`` call with the same sampling (n samples, temperature 1, the sampled token's logprob).
Service: one rollout worker started by its console script (``rlfleet-rollout serve --config``)
against an embedded nats-server; a ``GenerateRequest`` over NATS, the result fetched from the
worker's TensorStore over gRPC (what the reward and trainer tiers do). Throughput counts generated
tokens (the response mask) over wall time, end to end. Rounds alternate between the two paths
after a warm-up of each; each figure is the median. Results: benchmarks/results/rollout.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import GenerateRequest, GenerateResult, SamplingParams
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject
from rlfleet.common.errors import NoResponders, RequestTimeout
from rlfleet.common.tensors.store import TensorStoreClient

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "rollout.json"
CLUSTER = "bench"
GENERATE = subject(CLUSTER, "rollout", "generate")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny:bench", help="'tiny:<name>', 'smollm2' or a local HF dir")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--prompts", type=int, default=64, help="prompts per call")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=96, help="response length cap")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per path")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.3,
        help="CUDA: each engine's share of the GPU (the bare engine and the worker share one)",
    )
    parser.add_argument(
        "--eager", action="store_true", help="CUDA: no torch.compile / CUDA graphs (both paths)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


def make_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """Distinct short arithmetic-like prompts (no shared prefix beyond BOS)."""
    texts = [f"q{i}: {i % 7} {i % 5} {(i * 3) % 11} ->" for i in range(count)]
    return [tokenizer(t)["input_ids"] for t in texts]


def worker_settings(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    """The rollout worker's config; the bare engine gets the same vLLM settings from it."""
    return {
        "model_path": model_path, "engine": "vllm", "device": args.device,
        "dtype": "float32" if args.device == "cpu" else "bfloat16", "max_batch_size": args.prompts * args.n,
        "cache_policy": "lru", "max_cache_len": 512, "cluster": CLUSTER, "worker_id": "rollout-bench",
        "log_level": "WARNING", "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": True if args.eager or args.device == "cpu" else None,
    }  # fmt: skip


def bare_rounds(settings: dict[str, Any], prompts: list[list[int]], sampling: SamplingParams) -> Any:
    """A generator: each ``next()`` times one bare ``LLM.generate`` call -> (tokens, seconds)."""
    from rlfleet.common.schema.rollout import RolloutWorkerConfig
    from rlfleet.rollout.engines.checkpoint import read_checkpoint
    from rlfleet.rollout.engines.vllm import LOGPROBS_MODE
    from rlfleet.rollout.engines.vllm.runtime import context_cap, import_vllm
    from rlfleet.rollout.service import engine_kwargs

    kwargs = engine_kwargs(RolloutWorkerConfig(**settings), "vllm", settings["device"])
    info = read_checkpoint(settings["model_path"])
    vllm = import_vllm(settings["device"], 1.0)
    llm = vllm.LLM(
        model=settings["model_path"],
        dtype=kwargs["dtype"],
        seed=0,
        max_num_seqs=kwargs["max_batch_size"],
        max_model_len=context_cap(kwargs["max_model_len"], info.max_positions),
        enforce_eager=kwargs["enforce_eager"],
        enable_prefix_caching=kwargs["enable_prefix_caching"],
        distributed_executor_backend="uni",
        logprobs_mode=LOGPROBS_MODE,
        **(
            {"gpu_memory_utilization": kwargs["gpu_memory_utilization"]}
            if settings["device"] == "cuda"
            else {}
        ),
    )
    params = vllm.SamplingParams(
        n=sampling.n, temperature=sampling.temperature, max_tokens=sampling.max_tokens,
        stop_token_ids=list(info.eos_ids), logprobs=0,
    )  # fmt: skip
    inputs = [vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in prompts]
    while True:
        t0 = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        yield sum(len(c.token_ids) for o in outputs for c in o.outputs), seconds


async def wait_ready(transport: NatsTransport, deadline_s: float) -> None:
    """Until the worker answers a generate request (it subscribes once its engine is up)."""
    probe = GenerateRequest(job_id="probe", prompt_token_ids=[[1, 5]], sampling=SamplingParams(max_tokens=1))
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            await transport.request(GENERATE, probe, timeout=30.0, tier="rollout")
            return
        except (NoResponders, RequestTimeout):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def service_round(
    transport: NatsTransport, clients: dict[str, TensorStoreClient], prompts: list[list[int]],
    sampling: SamplingParams, index: int,
) -> tuple[int, float, float]:  # fmt: skip
    """One generate job end to end: request over NATS, reply, result tensors over gRPC.

    Returns (generated tokens, wall seconds, seconds the worker spent in ``engine.generate``).
    """
    request = GenerateRequest(job_id=f"bench-{index}", prompt_token_ids=prompts, sampling=sampling)
    t0 = time.perf_counter()
    reply = await transport.request(GENERATE, request, timeout=600.0, tier="rollout")
    assert isinstance(reply, GenerateResult)
    client = clients.setdefault(reply.ref.address, TensorStoreClient(reply.ref.address))
    tensors = await client.fetch(reply.ref)
    seconds = time.perf_counter() - t0
    await client.delete(reply.ref.key)
    return int(tensors["response_mask"].sum()), seconds, reply.seconds


def start_worker(settings: dict[str, Any], nats_url: str, folder: Path) -> subprocess.Popen[bytes]:
    config = folder / "rollout.yaml"
    config.write_text(yaml.safe_dump({**settings, "nats_url": nats_url}))
    from rlfleet.controller.launcher import find_script

    script = find_script("rlfleet-rollout")  # beside the interpreter, else on PATH
    log = (folder / "rollout.log").open("wb")
    return subprocess.Popen(
        [str(script), "serve", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT
    )


async def measure(
    args: argparse.Namespace, settings: dict[str, Any], prompts: list[list[int]], sampling: SamplingParams,
    nats_url: str, folder: Path,
) -> dict[str, list[float]]:  # fmt: skip
    """Start the worker, then alternate timed rounds of the two paths after one warm-up each."""
    keys = ("bare_tok", "bare_s", "svc_tok", "svc_s", "engine_s")
    rounds: dict[str, list[float]] = {key: [] for key in keys}
    worker = start_worker(settings, nats_url, folder)
    transport = await NatsTransport.connect(nats_url, name="bench", tier="controller")
    clients: dict[str, TensorStoreClient] = {}
    try:
        await wait_ready(transport, deadline_s=600.0)
        bare = bare_rounds(settings, prompts, sampling)
        next(bare)
        await service_round(transport, clients, prompts, sampling, -1)
        for i in range(args.reps):
            tokens, seconds = next(bare)
            rounds["bare_tok"].append(tokens)
            rounds["bare_s"].append(seconds)
            tokens, seconds, engine_seconds = await service_round(transport, clients, prompts, sampling, i)
            rounds["svc_tok"].append(tokens)
            rounds["svc_s"].append(seconds)
            rounds["engine_s"].append(engine_seconds)
            print(f"round {i}: bare {rounds['bare_tok'][-1] / rounds['bare_s'][-1]:.0f} tok/s, "
                  f"service {tokens / seconds:.0f} tok/s (engine {engine_seconds:.2f} of {seconds:.2f} s)",
                  flush=True)  # fmt: skip
    finally:
        for client in clients.values():
            await client.close()
        await transport.close()
        worker.terminate()
        worker.wait(timeout=60)
    return rounds


async def run(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(model_path), args.prompts)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, logprobs=True)
    settings = worker_settings(args, model_path)
    with EmbeddedNats() as nats, tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        r = await measure(args, settings, prompts, sampling, nats.url, Path(tmp))
    bare_rate = statistics.median(t / s for t, s in zip(r["bare_tok"], r["bare_s"], strict=True))
    service_rate = statistics.median(t / s for t, s in zip(r["svc_tok"], r["svc_s"], strict=True))
    overhead = statistics.median(1 - e / s for e, s in zip(r["engine_s"], r["svc_s"], strict=True))
    return {
        "bare_tok_s": round(bare_rate, 1),
        "service_tok_s": round(service_rate, 1),
        "ratio": round(service_rate / bare_rate, 3),
        "service_overhead_share": round(overhead, 3),
        "bare_seconds": [round(x, 3) for x in r["bare_s"]],
        "service_seconds": [round(x, 3) for x in r["svc_s"]],
        "service_engine_seconds": [round(x, 3) for x in r["engine_s"]],
        "bare_tokens": r["bare_tok"],
        "service_tokens": r["svc_tok"],
        "workload": {"model": args.model, "device": args.device, "prompts": args.prompts, "n": args.n,
                     "max_tokens": args.max_tokens, "temperature": 1.0, "logprobs": True, "reps": args.reps},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "load_avg_1m": round(os.getloadavg()[0], 2)},
    }  # fmt: skip


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlfleet.controller.models import resolve_model

    model_path = str(resolve_model(args.model))
    result = asyncio.run(run(args, model_path))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("bare_tok_s", "service_tok_s", "ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
