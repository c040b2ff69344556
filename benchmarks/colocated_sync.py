"""Colocated weight sync on one GPU: a trainer's publish + a vLLM engine's load by CUDA IPC.

    python3 benchmarks/colocated_sync.py --out $OUT/colocated_sync.json        # on a CUDA machine
    uv run --extra cpu python benchmarks/colocated_sync.py --smoke    # without CUDA: checks, runs nothing

``--smoke`` on a CUDA machine runs the tiny preset, one 1 MB bucket size, one round. Without CUDA
it checks what comes before the GPU (the arguments, main's imports, the model's config and the
actor's settings) and exits 0 saying so: every stage of the sync needs the GPU.

A Qwen2.5-0.5B-shaped model (random init; 494M parameters, 0.99 GB in bf16) is loaded by the
real trainer :class:`~rlfleet.trainer.actor.Actor` (float32 master weights, as a trainer rank
holds them) and served by the real :class:`~rlfleet.rollout.engines.vllm.VLLMEngine` on the same
GPU (its engine core is another process, as in a colocated run). One sync is what the fleet does
for a worker on the trainer's GPU:

1. publish: the actor's weights, bucket by bucket, cast to bf16 into flat GPU buffers
   (``iter_weight_buckets(on_device=True)``) and shared by IPC handle (``share_bucket``);
2. load: ``VLLMEngine.load_ipc`` (the engine core maps the buffers and reloads every block in
   place from them; nothing touches the host).

Reported: seconds and GB/s (bf16 payload over the wall time) of each stage and of the sum, the
device-to-device copy ceiling of the same bytes measured in the same run, and, for contrast, the
same sync over the host (pinned buckets handed to ``VLLMEngine.load_weights``, which crosses into
the engine core as safetensors bytes: the gRPC carrier's load path without the network). The
weights loaded by IPC are checked against the host path: greedy tokens must be identical.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import smoke
import torch

if TYPE_CHECKING:
    from transformers import Qwen2Config

    from rlfleet.common.schema.trainer import ModelSettings

RESULTS = Path(__file__).parent / "results" / "colocated_sync_h200.json"
QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 512}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "tiny"])
    p.add_argument("--bucket-mb", default="64,256,1024", help="comma list of bucket sizes to time")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rlfleet-colocated"))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    return smoke.parse(p, argv, {"preset": "tiny", "bucket_mb": "1", "reps": 1})


def model_config(preset: str) -> Qwen2Config:
    """The Qwen2 config of ``preset`` (bf16, tied embeddings)."""
    from transformers import Qwen2Config

    shape = QWEN25_05B if preset == "qwen2.5-0.5b" else TINY
    return Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=1e6,
                       rms_norm_eps=1e-6, torch_dtype="bfloat16")  # fmt: skip


def actor_settings() -> ModelSettings:
    """The trainer's model settings: float32 master weights, bf16 compute (as a trainer rank holds them)."""
    from rlfleet.common.schema.trainer import ModelSettings

    return ModelSettings(param_dtype="float32", mixed_precision="bf16")


def write_model(preset: str, path: Path, seed: int) -> Path:
    """A random-init Qwen2-style model of ``preset`` (bf16, tied) with a character tokenizer."""
    from transformers import Qwen2ForCausalLM

    from rlfleet.controller.tokenizers import build_char_tokenizer

    config = model_config(preset)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    build_char_tokenizer(model_max_length=2048).save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def copy_ceiling(nbytes: int, reps: int = 10) -> float:
    """GB/s of one device-to-device copy of ``nbytes`` (median of ``reps`` after 3 warm-ups)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return nbytes / statistics.median(times) / 1e9


def sync_ipc(actor: Any, engine: Any, bucket_bytes: int) -> dict[str, float]:
    """One publish (buckets on the GPU, shared by IPC) and one load into the engine; seconds of each."""
    from rlfleet.trainer.ipc_share import share_bucket

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    keep, shared = [], []
    for bucket in actor.iter_weight_buckets(bucket_bytes, dtype=torch.bfloat16, on_device=True):
        shared.append(share_bucket(bucket))
        keep.append(bucket)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    engine.load_ipc(shared)
    t2 = time.perf_counter()
    nbytes = sum(b.nbytes for b in shared)
    del keep
    return {
        "publish_s": t1 - t0,
        "load_s": t2 - t1,
        "total_s": t2 - t0,
        "bytes": nbytes,
        "buckets": len(shared),
    }


def sync_host(actor: Any, engine: Any, bucket_bytes: int) -> dict[str, float]:
    """The same sync through pinned host buckets and ``load_weights`` (the gRPC carrier's load path)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    nbytes = 0
    for bucket in actor.iter_weight_buckets(bucket_bytes, dtype=torch.bfloat16, pin_memory=True):
        nbytes += sum(t.numel() * t.element_size() for t in bucket.values())
        engine.load_weights(bucket)
    t1 = time.perf_counter()
    return {"total_s": t1 - t0, "bytes": nbytes}


def greedy(engine: Any) -> list[list[int]]:
    from rlfleet.common.control.messages import SamplingParams

    prompts = [[40, 41, 42, 43, 44], [50, 51, 52], [60, 61, 62, 63]]
    return [c.token_ids for c in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))]


def summarize(rounds: list[dict[str, float]]) -> dict[str, float]:
    out = {k: statistics.median(r[k] for r in rounds) for k in ("publish_s", "load_s", "total_s")}
    nbytes = rounds[0]["bytes"]
    out.update(
        bytes=nbytes,
        buckets=rounds[0]["buckets"],
        gb_s=nbytes / out["total_s"] / 1e9,
        publish_gb_s=nbytes / out["publish_s"] / 1e9,
        load_gb_s=nbytes / out["load_s"] / 1e9,
    )
    out["rounds_total_s"] = [round(r["total_s"], 4) for r in rounds]
    return out


def check_without_cuda(args: argparse.Namespace) -> int:
    """``--smoke`` without CUDA: what runs before the GPU (main's imports, the bucket sizes, the model's
    config, the actor's settings); nothing is timed or written."""
    from rlfleet.common.control.messages import SamplingParams  # noqa: F401  (greedy's)
    from rlfleet.rollout.engines.vllm import VLLMEngine  # noqa: F401
    from rlfleet.trainer.actor import Actor  # noqa: F401
    from rlfleet.trainer.distributed import init_distributed  # noqa: F401
    from rlfleet.trainer.ipc_share import share_bucket  # noqa: F401  (sync_ipc's)

    sizes = [float(x) for x in args.bucket_mb.split(",")]
    config, settings = model_config(args.preset), actor_settings()
    print(f"smoke without CUDA: {args.preset} ({config.num_hidden_layers} layers, {settings.param_dtype} "
          f"master weights), buckets {sizes} MB; skipped the sync itself: CUDA IPC between the trainer "
          "and vLLM on one GPU needs CUDA at every stage")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        if args.smoke:
            return check_without_cuda(args)
        print("colocated_sync needs a CUDA GPU", file=sys.stderr)
        return 2
    from rlfleet.rollout.engines.vllm import VLLMEngine
    from rlfleet.trainer.actor import Actor
    from rlfleet.trainer.distributed import init_distributed

    args.workdir.mkdir(parents=True, exist_ok=True)
    served = write_model(args.preset, args.workdir / "served", seed=0)
    trained = write_model(args.preset, args.workdir / "trained", seed=1)
    ctx = init_distributed("cuda")
    actor = Actor(trained, actor_settings(), ctx, device="cuda", learning_rate=1e-6)
    t0 = time.perf_counter()
    engine = VLLMEngine(served, dtype="bfloat16", device="cuda", enforce_eager=True, max_model_len=2048,
                        gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    engine_start_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "benchmark": "colocated_sync",
        "device": torch.cuda.get_device_name(0),
        "preset": args.preset,
        "torch": torch.__version__,
        "vllm": __import__("vllm").__version__,
        "python": platform.python_version(),
        "params": sum(p.numel() for p in actor.model.parameters()),
        "engine_start_s": round(engine_start_s, 1),
        "command": " ".join([sys.executable, *sys.argv]),
    }
    try:
        before = greedy(engine)
        by_size = {}
        for mb in [float(x) for x in args.bucket_mb.split(",")]:
            rounds = [sync_ipc(actor, engine, int(mb * 2**20)) for _ in range(args.reps + 1)][1:]  # 1 warm-up
            by_size[f"{mb:g}"] = summarize(rounds)
            print(f"bucket {mb:g} MB: {by_size[f'{mb:g}']}", flush=True)
        ipc_tokens = greedy(engine)
        host = [sync_host(actor, engine, 64 * 2**20) for _ in range(2)][1]
        host_tokens = greedy(engine)
        nbytes = next(iter(by_size.values()))["bytes"]
        ceiling = copy_ceiling(int(nbytes))
        best = min(by_size.values(), key=lambda r: r["total_s"])
        result.update(
            ipc=by_size,
            best_total_s=round(best["total_s"], 4),
            best_gb_s=round(best["gb_s"], 2),
            d2d_copy_gb_s=round(ceiling, 1),
            share_of_copy_ceiling=round(best["gb_s"] / ceiling, 4),
            target_s=0.2,
            target_met=best["total_s"] < 0.2,
            host_path={
                "total_s": round(host["total_s"], 4),
                "gb_s": round(host["bytes"] / host["total_s"] / 1e9, 2),
            },
            ipc_equals_host_load=ipc_tokens == host_tokens,
            weights_changed=before != ipc_tokens,
        )
    finally:
        engine.close()
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result.get("ipc_equals_host_load") else 1


if __name__ == "__main__":
    raise SystemExit(main())
