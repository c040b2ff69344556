"""Trainer throughput under FSDP2: the actor update (tokens/s, MFU) and the publish path (GB/s).

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/trainer.py \\
        --model qwen2-0.5b --variants eager,compile
    uv run --extra cpu python benchmarks/trainer.py --smoke     # one process, the tiny preset (CI's check)

Each rank builds nothing itself: rank 0 writes a Qwen2-style model with random weights (from a
preset config, bf16) to ``--workdir``, then every rank loads it through the real
:class:`rlfleet.trainer.actor.Actor` (float32 master weights, FSDP2 with bf16 compute and
float32 gradient reduction), on a batch of ``--rows`` sequences of ``--seq-len`` tokens (prompt
``--prompt-len``, the rest response; no padding). One update (the trainer's update loop on the
ppo family's policy loss) is one optimizer step over the whole batch (on-policy: no separate
old-logprob pass), each rank running its half.

FLOPs of one update, per sequence of T tokens of which R are response (logits are computed
only for the R + 1 response positions, ``logits_to_keep``), L layers, attention width d::

    6 * N_body * T  +  6 * V * H * (R + 1)  +  6 * L * T^2 * d     (causal attention: half of T^2)

N_body is the parameter count without the embedding (tied to the lm_head, whose product is the
second term). MFU is those FLOPs over time over the GPU's dense bf16 peak (989 TFLOP/s for an
H100/H200 SXM by the datasheet); the matmul rate measured on the card is reported beside it.

Publishing: the weights are gathered bucket by bucket to bf16 full tensors (``--bucket-mb``) and
(a) dropped (the gather alone), (b) staged by rank 0 in a TensorStore in pinned and (c) pageable
host memory, and (d) streamed from that store to a client over loopback gRPC. Each GB/s is the
bf16 payload over the wall time. Results go to ``--out`` (rank 0), with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import smoke
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlfleet.common.schema.trainer import ModelSettings, StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.grpo import policy_plan
from rlfleet.trainer.distributed import DistContext, init_distributed, setup_nccl
from rlfleet.trainer.loop import train_loop
from rlfleet.trainer.weights import iter_weight_buckets

logger = logging.getLogger(__name__)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                   "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936},
    "qwen2-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                   "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512},
}  # fmt: skip
PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, datasheet
RESULTS = Path(__file__).parent / "results" / "trainer_h200.json"
SMOKE = {"model": "tiny", "variants": "eager", "rows": 2, "micro_batch": 1, "seq_len": 32, "prompt_len": 16,
         "warmup": 0, "steps": 1, "bucket_mb": 0.0625}  # fmt: skip
"""``--smoke``: the tiny preset, 2 rows of 32 tokens, one update, then the publish path in 64 KiB buckets."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2-0.5b", choices=sorted(PRESETS))
    p.add_argument(
        "--variants", default="eager,compile",
        help="comma list of eager, compile, and either with -noreshard (keep gathered weights for backward)",
    )  # fmt: skip
    p.add_argument("--rows", type=int, default=64, help="sequences per update (all ranks)")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward per rank")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--sharding", default="auto", choices=["auto", "full", "hybrid", "none"])
    p.add_argument("--bucket-mb", type=float, default=512.0)
    p.add_argument("--workdir", default="/tmp/rlfleet-bench")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--skip-publish", action="store_true")
    p.add_argument("--profile", type=Path, default=None, help="profile one more update; kernel table here")
    p.add_argument("--profile-publish", type=Path, default=None, help="cProfile one gather round; stats here")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    return smoke.parse(p, argv, SMOKE)


def sync(ctx: DistContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    if ctx.distributed:
        dist.barrier()


def write_model(args: argparse.Namespace, ctx: DistContext) -> tuple[Path, Qwen2Config]:
    """Rank 0 saves a random-init model of the preset (bf16); every rank gets its path and config."""
    config = Qwen2Config(**PRESETS[args.model], tie_word_embeddings=True, max_position_embeddings=32768,
                         rope_theta=1e6, rms_norm_eps=1e-6, torch_dtype="bfloat16")  # fmt: skip
    path = Path(args.workdir) / args.model
    if ctx.is_main:
        torch.manual_seed(0)
        with torch.device(ctx.device):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(path)
        del model
    sync(ctx)
    return path, config


def make_batch(
    args: argparse.Namespace, vocab: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The same random batch on every rank: (N, P) prompts and (N, R) responses without padding."""
    gen = torch.Generator().manual_seed(1)
    n, p, r = args.rows, args.prompt_len, args.seq_len - args.prompt_len
    batch = {
        "prompt_ids": torch.randint(0, vocab, (n, p), generator=gen),
        "prompt_mask": torch.ones((n, p), dtype=torch.int64),
        "response_ids": torch.randint(0, vocab, (n, r), generator=gen),
        "response_mask": torch.ones((n, r), dtype=torch.int64),
    }
    advantages = torch.randn(n, generator=gen).sign()
    return {k: v.to(device) for k, v in batch.items()}, advantages.to(device)


def update_flops(config: Qwen2Config, num_params: int, args: argparse.Namespace) -> float:
    """FLOPs of one update (see the module docstring)."""
    t, r = args.seq_len, args.seq_len - args.prompt_len
    embed = config.vocab_size * config.hidden_size
    attn_width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    per_seq = (
        6 * (num_params - embed) * t + 6 * embed * (r + 1) + 6 * config.num_hidden_layers * t * t * attn_width
    )
    return float(per_seq * args.rows)


def matmul_tflops(device: torch.device) -> float | None:
    """A bf16 8192^3 product on random data, median of 10 after 3 warm-ups (None on CPU)."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def run_variant(
    args: argparse.Namespace, ctx: DistContext, path: Path, config: Qwen2Config, variant: str
) -> tuple[Actor, dict[str, Any]]:
    """Load the actor for ``variant`` and time ``--steps`` updates after ``--warmup``."""
    model = ModelSettings(param_dtype="float32", mixed_precision="bf16", sharding=args.sharding,
                          gradient_checkpointing=args.gradient_checkpointing)  # fmt: skip
    t0 = time.perf_counter()
    actor = Actor(
        path,
        model,
        ctx,
        device=str(ctx.device),
        attn_implementation="sdpa",
        learning_rate=1e-6,
        compile=variant.startswith("compile"),
        reshard_after_forward=not variant.endswith("-noreshard"),
    )
    load_s = time.perf_counter() - t0
    num_params = sum(p.numel() for p in actor.model.parameters())
    batch, adv = make_batch(args, config.vocab_size, ctx.device)
    on_gpu = ctx.device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    times, warm = [], []
    for i in range(args.warmup + args.steps):
        sync(ctx)
        t0 = time.perf_counter()
        metrics = update(actor, batch, adv, args.micro_batch)
        sync(ctx)
        (warm if i < args.warmup else times).append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    flops = update_flops(config, num_params, args)
    tokens = args.rows * args.seq_len
    result = {
        "variant": variant, "params": num_params, "load_s": round(load_s, 2),
        "warmup_s": [round(w, 3) for w in warm], "step_s": [round(s, 4) for s in times],
        "step_s_median": round(seconds, 4), "tokens_per_step": tokens,
        "tokens_per_s_per_gpu": round(tokens / seconds / ctx.world_size, 1),
        "tflops_per_gpu": round(flops / seconds / ctx.world_size / 1e12, 1),
        "mfu": round(flops / seconds / ctx.world_size / PEAK_BF16, 4) if on_gpu else None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_gpu else None,
        "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
    }  # fmt: skip
    return actor, result


def update(
    actor: Actor, batch: dict[str, torch.Tensor], adv: torch.Tensor, micro_batch: int
) -> dict[str, float]:
    """One policy update on ``adv`` (no KL term), as a trainer step runs it."""
    settings = StepSettings(update=UpdateSettings(micro_batch_size=micro_batch, kl_coef=0.0))
    return train_loop(policy_plan(actor, batch, adv, settings))


def profile_update(args: argparse.Namespace, ctx: DistContext, actor: Actor, vocab: int) -> None:
    """One more update under the profiler; rank 0 writes the kernels by device time to ``--profile``."""
    from torch.profiler import ProfilerActivity, profile

    batch, adv = make_batch(args, vocab, ctx.device)
    sync(ctx)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        update(actor, batch, adv, args.micro_batch)
        sync(ctx)
    if ctx.is_main:
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        args.profile.write_text(table)
        print("\n".join(table.splitlines()[:30]), flush=True)


def link_ceilings(ctx: DistContext, nbytes: int = 512 << 20) -> dict[str, float]:
    """What the links give on their own: a bf16 all-gather of ``nbytes`` in all, and a pinned
    device-to-host copy of ``nbytes`` (medians of 5 after a warm-up); GB/s of ``nbytes``."""
    if ctx.device.type != "cuda":
        return {}
    part = torch.randn(nbytes // 2 // ctx.world_size, device=ctx.device, dtype=torch.bfloat16)
    full = torch.empty(part.numel() * ctx.world_size, device=ctx.device, dtype=torch.bfloat16)
    host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)

    def median_s(fn: Any) -> float:
        times = []
        for i in range(6):
            sync(ctx)
            t0 = time.perf_counter()
            fn()
            sync(ctx)
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_s = median_s(lambda: gather(full, part)) if ctx.distributed else math.nan
    copy_s = median_s(lambda: host.copy_(full, non_blocking=True))
    return {
        "allgather_gb_s": round(nbytes / 1e9 / gather_s, 1) if ctx.distributed else None,
        "d2h_pinned_gb_s": round(nbytes / 1e9 / copy_s, 1),
    }


def publish_path(args: argparse.Namespace, ctx: DistContext, actor: Actor) -> dict[str, Any]:
    """GB/s of gather only, gather + stage (pinned, pageable), and the loopback gRPC stream."""
    from rlfleet.common.tensors.store import TensorStoreClient, TensorStoreServer

    bucket = int(args.bucket_mb * 2**20)
    out: dict[str, Any] = {"bucket_mb": args.bucket_mb, **link_ceilings(ctx)}

    def timed(fn: Any) -> float:
        sync(ctx)
        t0 = time.perf_counter()
        fn()
        sync(ctx)
        return time.perf_counter() - t0

    def gather_only() -> None:  # every rank gathers every bucket in bf16 and keeps nothing
        for _ in iter_weight_buckets(actor.model, bucket, dtype=torch.bfloat16, keep=False):
            pass

    def follow_stage(pin: bool) -> None:  # ranks > 0 during rank 0's staging round
        for _ in actor.iter_weight_buckets(bucket, dtype=torch.bfloat16, pin_memory=pin):
            pass

    nbytes = sum(p.numel() for p in actor.model.parameters()) * 2
    out["payload_gb"] = round(nbytes / 1e9, 3)
    out["gather_gb_s"] = round(nbytes / 1e9 / min(timed(gather_only) for _ in range(3)), 1)
    if args.profile_publish is not None:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(timed, gather_only)
        if ctx.is_main:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
            args.profile_publish.write_text(text.getvalue())

    async def stage_and_stream() -> None:
        """Rounds of staging into one store, the previous version deleted first (as the trainer
        worker does, so that freed pinned buffers are reused), then one gRPC fetch of it all."""
        server = TensorStoreServer(capacity_bytes=64 << 30, ttl_s=3600.0)
        address = await server.start()
        try:
            refs: list[Any] = []
            for name, pin in (
                ("pinned_first", True),
                ("pinned", True),
                ("pinned", True),
                ("pageable", False),
            ):
                for ref in refs:
                    server.delete(ref.key)
                refs = []
                sync(ctx)
                t0 = time.perf_counter()
                for i, b in enumerate(
                    actor.iter_weight_buckets(bucket, dtype=torch.bfloat16, pin_memory=pin)
                ):
                    refs.append(server.put_local(f"{name}/{i}", b))
                sync(ctx)
                out[f"stage_{name}_gb_s"] = round(nbytes / 1e9 / (time.perf_counter() - t0), 1)

            client = TensorStoreClient(address)
            t0 = time.perf_counter()
            for ref in refs:
                await client.fetch(ref)
            out["stream_grpc_gb_s"] = round(nbytes / 1e9 / (time.perf_counter() - t0), 2)
            await client.close()
        finally:
            await server.stop()

    if ctx.is_main:
        asyncio.run(stage_and_stream())
    else:
        for pin in (True, True, True, False):
            timed(lambda: follow_stage(pin))  # noqa: B023  (called at once)
    # pinned buckets take the overlapped (side-stream) path on the GPU, pageable ones the plain one
    staged = [
        {k: v.clone() for b in actor.iter_weight_buckets(bucket, dtype=torch.bfloat16, pin_memory=pin)
         for k, v in b.items()}
        for pin in (True, False)
    ]  # fmt: skip
    out["pinned_equals_pageable"] = staged[0].keys() == staged[1].keys() and all(
        torch.equal(staged[0][k], staged[1][k]) for k in staged[0]
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_nccl(timeout_minutes=20)
    ctx = init_distributed("auto", args.sharding)
    path, config = write_model(args, ctx)
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else platform.processor()
    report: dict[str, Any] = {
        "command": " ".join(["python3 -m torch.distributed.run --standalone",
                             f"--nproc_per_node={ctx.world_size}", *sys.argv]),
        "model": args.model, "config": PRESETS[args.model], "world_size": ctx.world_size,
        "sharding": ctx.sharding, "rows": args.rows, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "prompt_len": args.prompt_len, "gradient_checkpointing": args.gradient_checkpointing,
        "device": device,
        "torch": torch.__version__, "peak_bf16_tflops": PEAK_BF16 / 1e12,
        "matmul_tflops_measured": matmul_tflops(ctx.device), "variants": [],
    }  # fmt: skip
    actor = None
    for variant in args.variants.split(","):
        del actor
        torch.cuda.empty_cache() if ctx.device.type == "cuda" else None
        actor, result = run_variant(args, ctx, path, config, variant)
        report["variants"].append(result)
        if ctx.is_main:
            print(json.dumps(result), flush=True)
    if args.profile is not None and actor is not None:
        profile_update(args, ctx, actor, config.vocab_size)
    if not args.skip_publish and actor is not None:
        report["publish"] = publish_path(args, ctx, actor)
    if ctx.is_main:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2), flush=True)
    if ctx.distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
