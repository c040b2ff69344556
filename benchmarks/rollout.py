"""Rollout throughput: bare ``vllm.LLM.generate`` against the rlfleet rollout service on the same prompts.

    uv run --extra cpu python benchmarks/rollout.py                      # tiny model, CPU
    uv run --extra cpu python benchmarks/rollout.py --model smollm2 --prompts 16 --max-tokens 64
    uv run --extra cpu python benchmarks/rollout.py --smoke              # 2 prompts x 2, 1 round (CI)
    uv run --extra gpu python benchmarks/rollout.py --model PATH --device cuda --prompts 256

Both paths run the rollout worker's default engine settings (CUDA graphs on CUDA, eager on CPU;
``--eager`` forces eager on both; ``--gpu-memory-utilization auto`` leaves the worker's own
sizing, a float fixes the share for both).

Service: one rollout worker started by its console script (``rlfleet-rollout serve --config``)
against an embedded nats-server; a ``GenerateRequest`` over NATS, the result fetched from the
worker's TensorStore over gRPC through the ref's capability, as the reward and trainer tiers
fetch. Like them, the benchmark never deletes a batch: only the store's owner (the worker, which
holds the store's secret) may, and it drops them on its next weight load or after its TTL.
Bare: ``vllm.LLM`` in this process, built with the arguments the worker's ``VLLMEngine`` gives
vLLM (the same share from ``memory_budget.engine_memory_fraction`` under ``auto``), one
``generate`` call with the same sampling (n samples, temperature 1, the sampled token's logprob).

The paths run one after the other, never side by side: the service phase (warm-up, then the
timed rounds), the worker stopped (its exit frees its engine's memory), then the bare phase. On
one GPU each engine takes its share of the card, so two resident engines may not fit; the service
goes first so the worker starts on a card this process has not touched, as in a run. Each path
gets the machine to itself, at the cost that load drifting between phases is not averaged out as
alternating rounds would. Throughput counts generated tokens (the response mask)
over wall time, end to end; each figure is the median of the timed rounds, and ``ratio`` is
service / bare. The JSON names the machine (CPU model and its bf16 flags; on CUDA the GPU) and
the torch and vLLM versions. Results: benchmarks/results/rollout.json (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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
from typing import Any, Literal

import smoke
import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import GenerateRequest, GenerateResult, SamplingParams
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject
from rlfleet.common.errors import NoResponders, RequestTimeout
from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.common.tensors.store import TensorStoreClient, worker_client

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "rollout.json"
CLUSTER = "bench"
GENERATE = subject(CLUSTER, "rollout", "generate")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The /proc/cpuinfo flags recorded with a CPU result (bf16 is emulated without the last two)."""
Rounds = dict[str, list[float]]


def memory_share(text: str) -> float | Literal["auto"]:
    """``--gpu-memory-utilization``: ``auto`` or a share in (0, 1]."""
    if text == "auto":
        return "auto"
    share = float(text)
    if not 0.0 < share <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'auto' or a share in (0, 1]")
    return share


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny:bench", help="'tiny:<name>', 'smollm2', a local HF dir or "
                        "'shape:<preset>' (colocated_sync.py's random-init Qwen2 shapes, e.g. "
                        "shape:qwen2.5-0.5b; written on the GPU)")  # fmt: skip
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--prompts", type=int, default=64, help="prompts per call")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=96, help="response length cap")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per path")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=memory_share,
        default="auto",
        help="CUDA: each engine's share of the GPU; auto (default) = the worker's own sizing",
    )
    parser.add_argument(
        "--eager", action="store_true", help="no torch.compile / CUDA graphs on CUDA (both paths)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="the result JSON")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    return smoke.parse(parser, None, {"prompts": 2, "n": 2, "max_tokens": 8, "reps": 1})


def make_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """Distinct short arithmetic-like prompts (no shared prefix beyond BOS)."""
    texts = [f"q{i}: {i % 7} {i % 5} {(i * 3) % 11} ->" for i in range(count)]
    return [tokenizer(t)["input_ids"] for t in texts]


def worker_settings(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    """The rollout worker's config; left out, a setting keeps the worker's default."""
    engine: dict[str, Any] = {"type": "vllm", "enable_prefix_caching": True, "max_model_len": 512}
    if args.eager:
        engine["enforce_eager"] = True
    if args.gpu_memory_utilization != "auto":
        engine["gpu_memory_utilization"] = args.gpu_memory_utilization
    return {
        "model_path": model_path, "placement": {"device": args.device}, "fleet": {"cluster": CLUSTER},
        "rollout": {"engine": engine, "dtype": "float32" if args.device == "cpu" else "bfloat16",
                    "max_batch_size": args.prompts * args.n},
        "worker_id": "rollout-bench", "log_level": "WARNING",
    }  # fmt: skip


def bare_llm_kwargs(cfg: RolloutWorkerConfig, device: str, info: Any) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments the worker's ``VLLMEngine`` builds from ``cfg`` (kept in step by hand:
    the engine builds them inline)."""
    from rlfleet.rollout.engines.vllm.engine import LOGPROBS_MODE, WORKER_EXTENSION
    from rlfleet.rollout.engines.vllm.runtime import DTYPES, context_cap
    from rlfleet.rollout.service import engine_kwargs

    kw = engine_kwargs(cfg, device)
    tp = kw["tensor_parallel_size"]
    llm_kwargs = {
        "model": str(cfg.model_path), "dtype": DTYPES[kw["dtype"]], "seed": kw["seed"],
        "max_num_seqs": kw["max_batch_size"],
        "max_model_len": context_cap(kw["max_model_len"], info.max_positions),
        "tensor_parallel_size": tp, "distributed_executor_backend": "uni" if tp == 1 else "mp",
        "enforce_eager": kw["enforce_eager"], "enable_prefix_caching": kw["enable_prefix_caching"],
        "logprobs_mode": LOGPROBS_MODE, "worker_extension_cls": WORKER_EXTENSION,
        "trust_remote_code": kw["trust_remote_code"],
    }  # fmt: skip
    if device == "cuda":
        share = kw["gpu_memory_utilization"]
        if share == "auto":
            from rlfleet.rollout.engines.vllm.memory_budget import engine_memory_fraction

            share = engine_memory_fraction(
                info.config, info.weights, dtype=llm_kwargs["dtype"], max_num_seqs=kw["max_batch_size"],
                max_model_len=llm_kwargs["max_model_len"], tensor_parallel_size=tp,
            ).share  # fmt: skip
        llm_kwargs.update(gpu_memory_utilization=share, enable_sleep_mode=kw["colocate"])
    return llm_kwargs


def bare_phase(
    cfg: RolloutWorkerConfig, device: str, prompts: list[list[int]], sampling: SamplingParams, reps: int
) -> tuple[Rounds, dict[str, Any]]:
    """Build the bare engine, time one warm-up and ``reps`` ``LLM.generate`` calls, shut it down.

    Returns the rounds (``bare_tok``, ``bare_s``) and the ``vllm.LLM`` arguments it ran with.
    """
    from rlfleet.rollout.engines.checkpoint import read_checkpoint
    from rlfleet.rollout.engines.vllm.runtime import import_vllm

    info = read_checkpoint(cfg.model_path, trust_remote_code=cfg.loading.trust_remote_code)
    vllm = import_vllm(device, 1.0)  # 1 GiB of CPU KV cache: the engine's default, as the worker's
    llm_kwargs = bare_llm_kwargs(cfg, device, info)
    if device == "cuda":  # an engine-core process started from here stalled at start-up twice on an H100
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = vllm.LLM(**llm_kwargs)
    params = vllm.SamplingParams(
        n=sampling.n, temperature=sampling.temperature, max_tokens=sampling.max_tokens,
        stop_token_ids=list(info.eos_ids), logprobs=0,
    )  # fmt: skip
    inputs = [vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in prompts]
    rounds: Rounds = {"bare_tok": [], "bare_s": []}
    try:
        for i in range(-1, reps):  # round -1 is the warm-up
            t0 = time.perf_counter()
            outputs = llm.generate(inputs, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            if i >= 0:
                rounds["bare_tok"].append(tokens)
                rounds["bare_s"].append(seconds)
                print(f"bare round {i}: {tokens / seconds:.0f} tok/s ({seconds:.2f} s)", flush=True)
    finally:
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()  # as VLLMEngine.close: the engine-core process lets go of the GPU
        del llm
        gc.collect()
    return rounds, llm_kwargs


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
    transport: NatsTransport, clients: dict[str, TensorStoreClient], cfg: RolloutWorkerConfig,
    prompts: list[list[int]], sampling: SamplingParams, index: int,
) -> tuple[int, float, float]:  # fmt: skip
    """One generate job end to end: request over NATS, reply, result tensors over gRPC.

    The fetch reads through the capability the ref carries, with the worker's tensor plane
    settings, as a consumer tier does; the batch stays the worker's to delete.
    Returns (generated tokens, wall seconds, seconds the worker spent in ``engine.generate``).
    """
    request = GenerateRequest(job_id=f"bench-{index}", prompt_token_ids=prompts, sampling=sampling)
    t0 = time.perf_counter()
    reply = await transport.request(GENERATE, request, timeout=600.0, tier="rollout")
    assert isinstance(reply, GenerateResult)
    client = clients.get(reply.ref.address)
    if client is None:
        client = clients[reply.ref.address] = worker_client(reply.ref.address, cfg.tensor_plane)
    tensors = await client.fetch(reply.ref)
    seconds = time.perf_counter() - t0
    return int(tensors["response_mask"].sum()), seconds, reply.seconds


def start_worker(settings: dict[str, Any], nats_url: str, folder: Path) -> subprocess.Popen[bytes]:
    config = folder / "rollout.yaml"
    config.write_text(yaml.safe_dump({**settings, "fleet": {**settings["fleet"], "nats_url": nats_url}}))
    from rlfleet.controller.launcher import find_script

    script = find_script("rlfleet-rollout")  # beside the interpreter, else on PATH
    log = (folder / "rollout.log").open("wb")
    return subprocess.Popen(
        [str(script), "serve", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT
    )


async def service_phase(
    settings: dict[str, Any], prompts: list[list[int]], sampling: SamplingParams, reps: int, folder: Path,
) -> Rounds:  # fmt: skip
    """Start the worker, time one warm-up and ``reps`` jobs, stop it (its engine frees the GPU).

    Returns the rounds: ``svc_tok``, ``svc_s`` and ``engine_s`` (the worker's ``engine.generate``).
    """
    cfg = RolloutWorkerConfig(**settings)
    rounds: Rounds = {"svc_tok": [], "svc_s": [], "engine_s": []}
    with EmbeddedNats() as nats:
        worker = start_worker(settings, nats.url, folder)
        transport = await NatsTransport.connect(nats.url, name="bench", tier="controller")
        clients: dict[str, TensorStoreClient] = {}
        try:
            await wait_ready(transport, deadline_s=600.0)
            for i in range(-1, reps):  # round -1 is the warm-up
                tokens, seconds, engine_s = await service_round(transport, clients, cfg, prompts, sampling, i)
                if i >= 0:
                    for key, value in zip(rounds, (tokens, seconds, engine_s), strict=True):
                        rounds[key].append(value)
                    print(f"service round {i}: {tokens / seconds:.0f} tok/s ({seconds:.2f} s, "
                          f"engine {engine_s:.2f} s)", flush=True)  # fmt: skip
        finally:
            for client in clients.values():
                await client.close()
            await transport.close()
            worker.terminate()
            worker.wait(timeout=120)
    return rounds


def machine(device: str) -> dict[str, Any]:
    """The host: CPU model and its bf16-relevant flags, the GPU on CUDA, torch and vLLM versions (None
    where vLLM is not installed)."""
    import importlib.util

    import torch

    from rlfleet.common.schema.trainer import cpu_has_native_bf16

    vllm_version = None  # a run that starts no engine (the GPU machine's light set) has no vLLM
    if importlib.util.find_spec("vllm") is not None:
        import vllm

        vllm_version = vllm.__version__

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines) if v}  # last CPU's
    flags = set(field.get("flags", "").split())
    return {
        "cpu": field.get("model name", platform.processor()), "cpus": os.cpu_count(),
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS}, "cpu_native_bf16": cpu_has_native_bf16(),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "torch": torch.__version__, "vllm": vllm_version, "platform": platform.platform(),
        "python": platform.python_version(),
    }  # fmt: skip


def median_rate(tokens: list[float], seconds: list[float]) -> float:
    return statistics.median(t / s for t, s in zip(tokens, seconds, strict=True))


async def run(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    """The service phase, then the bare phase, on the same prompts; the result record."""
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(model_path), args.prompts)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, logprobs=True)
    settings = worker_settings(args, model_path)
    load = {"service": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        r = await service_phase(settings, prompts, sampling, args.reps, Path(tmp))
    load["bare"] = round(os.getloadavg()[0], 2)
    bare, llm_kwargs = bare_phase(RolloutWorkerConfig(**settings), args.device, prompts, sampling, args.reps)
    r.update(bare)
    bare_rate, service_rate = median_rate(r["bare_tok"], r["bare_s"]), median_rate(r["svc_tok"], r["svc_s"])
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
        "order": ["service", "bare"],
        "load_avg_1m": load,
        "workload": {"model": args.model, "device": args.device, "prompts": args.prompts, "n": args.n,
                     "max_tokens": args.max_tokens, "temperature": 1.0, "logprobs": True, "reps": args.reps},
        "engine": {"gpu_memory_utilization": args.gpu_memory_utilization, "eager": args.eager,
                   "vllm_llm": {k: v for k, v in llm_kwargs.items() if k != "model"},
                   "bare_engine_core": "in-process" if args.device == "cuda" else "vllm default"},
        "machine": machine(args.device),
        "command": " ".join(["benchmarks/rollout.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip


def print_table(result: dict[str, Any]) -> None:
    rows = [("service", result["service_tok_s"], result["service_seconds"]),
            ("bare", result["bare_tok_s"], result["bare_seconds"])]  # fmt: skip
    print(f"{'path':<8} {'tok/s':>9}  seconds per round")
    for name, rate, seconds in rows:
        print(f"{name:<8} {rate:>9.1f}  {' '.join(f'{s:.2f}' for s in seconds)}")
    host = result["machine"]["gpu"] or result["machine"]["cpu"]
    print(f"ratio service/bare {result['ratio']:.3f}; service time outside the engine "
          f"{result['service_overhead_share']:.1%}; {host}")  # fmt: skip


def shaped_model(preset: str) -> Path:
    """A random-init model of ``preset`` (written once, by a child process: this one stays off the
    GPU until the bare phase, as the module says)."""
    target = Path(tempfile.gettempdir()) / "rlfleet-rollout-bench" / preset
    if not (target / "config.json").exists():
        code = ("import sys; from pathlib import Path; from colocated_sync import write_model; "
                "write_model(sys.argv[1], Path(sys.argv[2]), seed=0)")  # fmt: skip
        here = Path(__file__).parent
        subprocess.run([sys.executable, "-c", code, preset, str(target)], cwd=here, check=True)
    return target


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlfleet.controller.models import resolve_model

    shaped = args.model.startswith("shape:")
    model_path = str(shaped_model(args.model[6:]) if shaped else resolve_model(args.model))
    result = asyncio.run(run(args, model_path))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
