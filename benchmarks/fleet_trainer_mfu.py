"""MFU of the fleet's trainer: a GRPO step as a trainer rank runs it, on a random-init Qwen2 preset.

    python3 benchmarks/fleet_trainer_mfu.py --models qwen2-0.5b,qwen2-1.5b \\
        --variants eager-mb8,compile-mb8,compile-mb16
    uv run --extra cpu python benchmarks/fleet_trainer_mfu.py --smoke   # CPU, tiny, eager-mb2-kl-ragged (CI)

Where ``benchmarks/trainer.py`` times ``train_loop`` on a bare policy loss, this script runs what
``trainer.step`` runs, in-process (one rank, or torchrun's ranks): the models come from
``rlfleet.trainer.ranks.build_models`` of a ``TrainerWorkerConfig`` (the worker's defaults, the
variant's micro-batch, ``compile`` and ``kl_coef``), the batch is a rollout batch of the contract
(``RolloutBatch.from_rows`` -> ``to_tensors`` -> the service's ``merge_batch``: left-padded
prompts, right-padded responses, rollout logprobs, group indices; on the host, as fetched) and the
step is the service's ``run_step`` (GRPO advantages from the scores, the reference's logprobs when
``kl_coef > 0``, the update loop, the optimizer step). Every ``--group`` rows share a prompt.

A variant is ``{eager|compile}-mb<N>`` with optional ``-kl`` (``kl_coef`` 0.05, the GRPO default:
the reference model is loaded and runs a forward each step) and ``-ragged`` (prompts of P/2..P and
responses of R/4..R tokens, padded to the batch's widths, instead of all P + R), ``-lora`` (LoRA
adapters of rank 16, alpha 32 on every linear layer of the blocks, ``model.lora``: only they train,
and the reference is the base with them off) and ``-bf16`` (``param_dtype: bfloat16``: the weights
held in bf16, as a LoRA run keeps its frozen base; full training keeps float32 master weights).
For LoRA, the FLOPs below still count the weight gradients it skips (4 of the 6 per parameter and
token are done), so its ``mfu`` is an equal-work figure: compare its tokens/s with full training's.

FLOPs: ``update_flops`` of ``benchmarks/trainer.py`` (imported: ``6 N_body T + 6 V H (R + 1) + 6 L
T^2 d`` per sequence), summed over the rows at their real lengths; the reference's forward adds a
third of it (2 of the 6 per parameter and token). ``mfu`` counts both; ``mfu_update`` only the
update (the bare benchmark's figure); ``mfu_padded`` the update at the padded shapes the GPU
computes. Peak: 989 TFLOP/s (dense bf16, H100/H200 SXM datasheet), beside the measured bf16 matmul.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
import smoke  # noqa: E402  (this folder's helper module)
from async_pipeline import machine  # noqa: E402
from trainer import PEAK_BF16, PRESETS, matmul_tflops, sync, update_flops, write_model  # noqa: E402

from rlfleet.common.schema.batch import RolloutBatch  # noqa: E402
from rlfleet.common.schema.trainer import (  # noqa: E402
    BatchSettings,
    LoraSettings,
    ModelSettings,
    StepSettings,
    TrainerWorkerConfig,
    UpdateSettings,
)
from rlfleet.common.schema.worker import Placement  # noqa: E402
from rlfleet.trainer.distributed import DistContext, setup_nccl  # noqa: E402
from rlfleet.trainer.ranks import build_models  # noqa: E402
from rlfleet.trainer.service import merge_batch, run_step  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fleet_trainer_mfu_h200.json"
SMOKE = {"models": "tiny", "variants": "eager-mb2-kl-ragged", "rows": 4, "group": 2, "seq_len": 32,
         "prompt_len": 16, "warmup": 0, "steps": 1, "device": "cpu"}  # fmt: skip
"""``--smoke``: one step of the tiny preset on CPU, with the reference model and ragged rows."""
KL_COEF = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen2-0.5b,qwen2-1.5b", help=f"comma list of {sorted(PRESETS)}")
    p.add_argument(
        "--variants", default="eager-mb8,compile-mb8,compile-mb16",
        help="comma list of {eager|compile}-mb<N>[-kl][-ragged]; model:variant: on one model only",
    )  # fmt: skip
    p.add_argument("--rows", type=int, default=64, help="rollouts per step (prompts x group)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--workdir", default="/tmp/rlfleet-bench")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--profile",
        default="",
        help="comma list of model:variant: profile one more step of each (tables beside --out)",
    )
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    return smoke.parse(p, argv, SMOKE)


def parse_variant(name: str) -> dict[str, Any]:
    """``compile-mb16-kl`` -> {compile: True, micro_batch: 16, kl: True, ragged: False, lora: False,
    bf16: False}."""
    parts = name.split("-")
    if parts[0] not in ("eager", "compile") or len(parts) < 2 or not parts[1].startswith("mb"):
        raise SystemExit(f"variant {name!r}: expected {{eager|compile}}-mb<N>[-kl][-ragged][-lora][-bf16]")
    extra, known = set(parts[2:]), {"kl", "ragged", "lora", "bf16"}
    if extra - known:
        raise SystemExit(f"variant {name!r}: unknown parts {sorted(extra - known)}")
    return {"compile": parts[0] == "compile", "micro_batch": int(parts[1][2:]),
            **{part: part in extra for part in sorted(known)}}  # fmt: skip


def rollout_batch(
    args: argparse.Namespace, vocab: int, ragged: bool
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """A merged rollout batch of the contract (on the host, as the trainer fetches it) and its scores."""
    gen = torch.Generator().manual_seed(1)
    p_max, r_max = args.prompt_len, args.seq_len - args.prompt_len

    def length(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen)) if ragged else high

    prompts, responses, logprobs, groups = [], [], [], []
    for g in range(args.rows // args.group):
        prompt = torch.randint(1, vocab, (length(p_max // 2, p_max),), generator=gen).tolist()
        for _ in range(args.group):
            r = length(r_max // 4, r_max)
            prompts.append(prompt)
            responses.append(torch.randint(1, vocab, (r,), generator=gen).tolist())
            logprobs.append((-torch.rand(r, generator=gen) * 4).tolist())
            groups.append(g)
    chunk = RolloutBatch.from_rows(prompts=prompts, responses=responses, logprobs=logprobs,
                                   group_index=groups, pad_id=0).to_tensors()  # fmt: skip
    scores = torch.rand(len(prompts), generator=gen).tolist()  # continuous: no group has equal scores
    return merge_batch("grpo", [chunk]), scores


def step_flops(config: Any, num_params: int, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(update FLOPs at the rows' real lengths, at the padded shapes) by ``trainer.update_flops``."""
    prompt, response = batch["prompt_mask"].sum(dim=1).tolist(), batch["response_mask"].sum(dim=1).tolist()
    real = sum(update_flops(config, num_params, SimpleNamespace(rows=1, seq_len=p + r, prompt_len=p))
               for p, r in zip(prompt, response, strict=True))  # fmt: skip
    n, p_width = batch["prompt_ids"].shape
    padded = update_flops(config, num_params, SimpleNamespace(
        rows=n, seq_len=p_width + batch["response_ids"].shape[1], prompt_len=p_width))  # fmt: skip
    return real, padded


def run_variant(
    args: argparse.Namespace, path: Path, config: Any, model: str, name: str
) -> tuple[dict[str, Any], Any]:
    """Build the trainer's models for the variant and time ``--steps`` of ``run_step`` after ``--warmup``."""
    v = parse_variant(name)
    n_prompts = args.rows // args.group
    step = StepSettings(
        algorithm="grpo",
        update=UpdateSettings(micro_batch_size=v["micro_batch"], kl_coef=KL_COEF if v["kl"] else 0.0),
        batch=BatchSettings(rollout_batch_size=n_prompts, train_batch_size=n_prompts, group_size=args.group),
    )
    lora = LoraSettings(rank=16, alpha=32.0) if v["lora"] else None
    model_settings = ModelSettings(
        compile=v["compile"], lora=lora, param_dtype="bfloat16" if v["bf16"] else "float32"
    )
    cfg = TrainerWorkerConfig(model_path=str(path), placement=Placement(device=args.device, seed=0),
                              model=model_settings, step=step)  # fmt: skip
    t0 = time.perf_counter()
    ctx, actor, critic = build_models(cfg)
    load_s = time.perf_counter() - t0
    settings = StepSettings.of(cfg)
    num_params = sum(p.numel() for n, p in actor.model.named_parameters() if ".lora_" not in n)  # the base's
    batch, scores = rollout_batch(args, config.vocab_size, v["ragged"])
    on_gpu = ctx.device.type == "cuda"
    times, warm, metrics, peak_gib = [], [], {}, 0.0
    for i in range(args.warmup + args.steps):
        sync(ctx)
        t0 = time.perf_counter()
        metrics = run_step(actor, critic, batch, scores, settings)
        sync(ctx)
        (warm if i < args.warmup else times).append(time.perf_counter() - t0)
        # run_step resets the peak at each phase and reports each phase's (GPU only)
        peak_gib = max(peak_gib, metrics.get("memory/step_peak_allocated_gib", 0.0))
    seconds = statistics.median(times)
    real, padded = step_flops(config, num_params, batch)
    total = real * (4 / 3 if v["kl"] else 1.0)  # the reference's forward: a third of the update
    tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    per_gpu = seconds * ctx.world_size

    def mfu(flops: float) -> float | None:
        return round(flops / per_gpu / PEAK_BF16, 4) if on_gpu else None

    result = {
        "model": model, "variant": name, **v, "world_size": ctx.world_size, "params": num_params,
        "trainable_params": sum(p.numel() for p in actor.model.parameters() if p.requires_grad),
        "load_s": round(load_s, 2), "warmup_s": [round(w, 3) for w in warm],
        "step_s": [round(s, 4) for s in times],
        "step_s_median": round(seconds, 4), "tokens_per_step": tokens,
        "padded_tokens_per_step": int(batch["prompt_ids"].numel() + batch["response_ids"].numel()),
        "tokens_per_s_per_gpu": round(tokens / per_gpu, 1),
        "tflops_per_gpu": round(total / per_gpu / 1e12, 1),
        "mfu": mfu(total), "mfu_update": mfu(real), "mfu_padded": mfu(padded),
        "peak_memory_gib": round(peak_gib, 2) if on_gpu else None,
        "service_train_tok_s": round(metrics["throughput/train_tok_s"], 1),
        "metrics": {k: round(metrics[k], 5) for k in ("loss", "pg_loss", "entropy", "grad_norm", "kl")
                    if k in metrics},
    }  # fmt: skip
    if f"{model}:{name}" in args.profile.split(","):
        profile_step(args, actor, critic, batch, scores, settings, ctx, f"{model}_{name}")
    del actor, critic
    return result, ctx


def profile_step(
    args: argparse.Namespace, actor: Any, critic: Any, batch: dict[str, torch.Tensor], scores: list[float],
    settings: StepSettings, ctx: DistContext, tag: str,
) -> None:  # fmt: skip
    """One more step under the profiler; the kernels by device time go beside ``--out``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    sync(ctx)
    with profile(activities=activities) as prof:
        run_step(actor, critic, batch, scores, settings)
        sync(ctx)
    sort = "cuda_time_total" if ctx.device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=80)
    out = args.out.parent / f"profile_{tag}.txt"
    out.write_text(table)
    print("\n".join(table.splitlines()[:25]), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_nccl(timeout_minutes=20)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    report: dict[str, Any] = {
        "what": "GRPO steps of the fleet's trainer (build_models + run_step), one process per GPU",
        "command": " ".join(["python3", *sys.argv]),
        "device": torch.cuda.get_device_name(device) if on_gpu else platform.machine(),
        "gpus": torch.cuda.device_count() if on_gpu else 0,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(), "rows": args.rows, "group": args.group,
        "seq_len": args.seq_len, "prompt_len": args.prompt_len, "peak_bf16_tflops": PEAK_BF16 / 1e12,
        "matmul_tflops_measured": matmul_tflops(device), "machine": machine(args.device), "results": [],
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        where = SimpleNamespace(model=model, workdir=args.workdir)
        path, config = write_model(where, DistContext(device=device))
        for spec in args.variants.split(","):
            only, _, name = spec.rpartition(":")
            if only and only != model:
                continue
            result, _ = run_variant(args, path, config, model, name)
            report["results"].append(result)
            print(json.dumps(result), flush=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")  # what ran so far, if a later one fails
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
