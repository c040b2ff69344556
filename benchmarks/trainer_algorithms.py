"""PPO (actor, reference and critic) and DPO steps under FSDP2: step time and peak memory per rank.

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/trainer_algorithms.py
    python3 -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/trainer_algorithms.py
    uv run --extra cpu python benchmarks/trainer_algorithms.py --smoke    # tiny preset, one process (CI)

Every rank builds the trainer's models exactly as a trainer worker does (``build_models`` of
``rlfleet.trainer.ranks``: the actor, and for PPO the critic, both FSDP2-sharded over the ranks)
from a random-init Qwen2 preset that rank 0 writes, and runs ``run_step`` (the worker's step)
on one random batch: PPO on ``--rows`` rollouts (GAE, clipped value loss, KL in the reward), DPO
on ``--rows`` preference pairs (reference log-probs computed by the trainer). It reports the
median step time, the peak GPU memory of each rank and the step's metrics, appended per world
size to ``--out`` (rank 0 writes), so a 1-rank and a 2-rank run sit side by side: the critic and
the pairs are split over the ranks, so per-rank memory and time should fall with 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import smoke  # noqa: E402  (this folder's helper module)
from trainer import PRESETS, sync, write_model  # noqa: E402  (benchmarks/trainer.py)

from rlfleet.common.schema.algorithms import ALGORITHMS  # noqa: E402
from rlfleet.common.schema.trainer import (  # noqa: E402
    ModelSettings,
    StepSettings,
    TrainerWorkerConfig,
    UpdateSettings,
)
from rlfleet.common.schema.worker import FleetAddress, Placement  # noqa: E402
from rlfleet.trainer.distributed import setup_nccl  # noqa: E402
from rlfleet.trainer.ranks import build_models  # noqa: E402
from rlfleet.trainer.service import merge_batch, run_step  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "trainer_algorithms_h200.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2-0.5b", choices=sorted(PRESETS))
    p.add_argument("--algorithms", default="ppo,dpo")
    p.add_argument("--rows", type=int, default=32, help="PPO rollouts / DPO pairs per step (all ranks)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=768)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    p.add_argument("--workdir", default="/tmp/rlfleet-bench")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    settings = {"model": "tiny", "rows": 2, "micro_batch": 1, "prompt_len": 8, "response_len": 8, "steps": 1}
    return smoke.parse(p, argv, settings)


def random_batch(args: argparse.Namespace, algorithm: str, vocab: int) -> dict[str, torch.Tensor]:
    """The same batch on every rank: prompts and responses of uneven lengths (right-padded)."""
    gen = torch.Generator().manual_seed(7)
    n, p, r = args.rows, args.prompt_len, args.response_len

    def responses() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, r), generator=gen)
        lengths = torch.randint(r // 4, r + 1, (n,), generator=gen)
        mask = (torch.arange(r)[None, :] < lengths[:, None]).long()
        return ids * mask, mask

    prompt = {"prompt_ids": torch.randint(0, vocab, (n, p), generator=gen),
              "prompt_mask": torch.ones((n, p), dtype=torch.int64)}  # fmt: skip
    if not ALGORITHMS[algorithm].online:  # preference pairs
        (chosen, chosen_mask), (rejected, rejected_mask) = responses(), responses()
        return {**prompt, "chosen_ids": chosen, "chosen_mask": chosen_mask,
                "rejected_ids": rejected, "rejected_mask": rejected_mask}  # fmt: skip
    ids, mask = responses()
    logprobs = -torch.rand((n, r), generator=gen) * mask
    return {**prompt, "response_ids": ids, "response_mask": mask, "rollout_logprobs": logprobs,
            "group_index": torch.arange(n)}  # fmt: skip


def run(args: argparse.Namespace, path: Path, vocab: int, algorithm: str) -> dict[str, Any]:
    cfg = TrainerWorkerConfig(
        model_path=str(path), fleet=FleetAddress(cluster="bench"), placement=Placement(device="auto", seed=0),
        model=ModelSettings(mixed_precision="bf16"),
        step=StepSettings(algorithm=algorithm, update=UpdateSettings(
            micro_batch_size=args.micro_batch, learning_rate=1e-6, kl_coef=0.05)),
    )  # fmt: skip
    ctx, actor, critic = build_models(cfg)
    batch = merge_batch(algorithm, [random_batch(args, algorithm, vocab)])
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(args.rows, generator=gen).tolist() if ALGORITHMS[algorithm].online else []
    settings = StepSettings.of(cfg)  # the worker's own: algorithm, micro-batch, kl_coef 0.05...
    on_gpu = ctx.device.type == "cuda"
    times, metrics, peak_gib = [], {}, 0.0
    for i in range(1 + args.steps):
        sync(ctx)
        t0 = time.perf_counter()
        metrics = run_step(actor, critic, batch, scores, settings)
        sync(ctx)
        if i:
            times.append(time.perf_counter() - t0)
        # run_step resets the peak at each phase and reports each phase's (GPU only)
        peak_gib = max(peak_gib, metrics.get("memory/step_peak_allocated_gib", 0.0))
    peak = torch.tensor([peak_gib], device=ctx.device)
    peaks = [torch.zeros_like(peak) for _ in range(ctx.world_size)]
    if ctx.distributed:
        dist.all_gather(peaks, peak)
    else:
        peaks = [peak]
    finite = all(math.isfinite(v) for v in metrics.values())
    keys = ("loss", "grad_norm", "critic/vf_loss", "critic/grad_norm", "kl_reward", "dpo/accuracy",
            "dpo/margin")  # fmt: skip
    result = {
        "algorithm": algorithm, "world_size": ctx.world_size, "sharding": ctx.sharding,
        "step_s": [round(t, 3) for t in times], "step_s_median": round(statistics.median(times), 3),
        "peak_gib_per_rank": [round(float(p.item()), 2) for p in peaks], "metrics_finite": finite,
        "metrics": {k: round(metrics[k], 5) for k in keys if k in metrics},
    }  # fmt: skip
    del actor, critic
    if on_gpu:
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_nccl(timeout_minutes=20)
    from rlfleet.trainer.distributed import init_distributed

    ctx = init_distributed("auto", "auto")  # rank 0 writes the model; build_models joins the same group
    path, config = write_model(argparse.Namespace(model=args.model, workdir=args.workdir), ctx)
    results = [run(args, path, config.vocab_size, algorithm) for algorithm in args.algorithms.split(",")]
    if ctx.is_main:
        report = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
        report["runs"] = [r for r in report["runs"] if r["world_size"] != ctx.world_size] + [{
            "command": f"python3 -m torch.distributed.run --standalone --nproc_per_node={ctx.world_size} "
            + " ".join(sys.argv), "model": args.model, "rows": args.rows, "world_size": ctx.world_size,
            "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "results": results,
        }]  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print("| algorithm | ranks | step s | peak GiB per rank | loss |")
        print("| --- | --- | --- | --- | --- |")
        for r in results:
            print(f"| {r['algorithm']} | {r['world_size']} | {r['step_s_median']} | {r['peak_gib_per_rank']} "
                  f"| {r['metrics'].get('loss')} |")  # fmt: skip
    if ctx.distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
