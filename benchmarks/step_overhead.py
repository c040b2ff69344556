"""Service overhead of a training step: the rlfleet fleet against the same work in one process.

    uv run --extra cpu python benchmarks/step_overhead.py                                  # the main job
    uv run --extra cpu python benchmarks/step_overhead.py --job examples/tiny_grpo.yaml --steps 5
    uv run --extra cpu python benchmarks/step_overhead.py --smoke      # the tiny job, 1 step a path (CI)

The design's target: NATS + gRPC add under 5% to a step, against the same work in one process.

Fleet: the job as ``rlfleet train`` runs it (embedded nats-server, trainer, reward and rollout
worker processes); each step's ``time/*`` metrics. In-process: the same code the workers run, in
this process, built from the same job (the worker configs the launcher would pass): the rollout
engine generates the step's prompts, ``to_rollout_tensors`` packs them, the reward spec scores them,
``run_step`` trains, and the actor's weight buckets go straight into the engine. Both paths see
the same prompts, seeds and weights, so they do the same work; after ``--warmup`` steps each, the
median step times are compared: ``overhead = fleet / in_process - 1``. Results:
``benchmarks/results/step_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import smoke

RESULTS = Path(__file__).parent / "results" / "step_overhead.json"
PHASES = ("generate", "score", "train", "publish")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", default="examples/smollm2_concise.yaml", help="job file, as for rlfleet train")
    p.add_argument("--steps", type=int, default=3, help="timed steps per path")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("overrides", nargs="*", help="key=value job overrides")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    return smoke.parse(p, None, {"job": "examples/tiny_grpo.yaml", "steps": 1, "warmup": 0})


def build(args: argparse.Namespace, output_dir: Path) -> Any:
    """The GRPO/PPO trainer the job describes (nothing started)."""
    from rlfleet.controller.cli import _load_job, build_trainer

    overrides = [*args.overrides, f"output_dir={output_dir}", "sample_table_size=0", "loggers=[jsonl]",
                 "save_every=0", f"max_steps={args.warmup + args.steps}"]  # fmt: skip
    return build_trainer(_load_job(Path(args.job), overrides))


def fleet_steps(args: argparse.Namespace, out: Path) -> list[dict[str, float]]:
    trainer = build(args, out / "fleet")
    rows = []
    try:
        for result in trainer.steps(num_epochs=100, max_steps=args.warmup + args.steps):
            m = result.metrics
            rows.append({"step_s": m["time/step_s"], **{p: m[f"time/{p}_s"] for p in PHASES},
                         "reward": m["reward/mean"], "loss": m["loss"]})  # fmt: skip
    finally:
        trainer.close()
    return rows[args.warmup :]


def in_process_steps(args: argparse.Namespace, out: Path) -> list[dict[str, float]]:
    import torch

    from rlfleet.common.schema.batch import unpack_texts
    from rlfleet.common.schema.trainer import StepSettings
    from rlfleet.reward.registry import build_reward
    from rlfleet.rollout.engines.registry import make_engine, resolve_engine_name
    from rlfleet.rollout.service import engine_kwargs, to_rollout_tensors
    from rlfleet.trainer.ranks import build_models
    from rlfleet.trainer.service import merge_batch, run_step

    trainer = build(args, out / "inproc")
    cfg = trainer.config
    specs = {spec.tier: spec.config for spec in reversed(trainer.fleet_run.worker_specs())}
    rollout_cfg = specs["rollout"]  # the first rollout worker's config, as the launcher would write it
    name = resolve_engine_name(rollout_cfg.rollout.engine.type)
    device = "cuda" if rollout_cfg.placement.device != "cpu" and torch.cuda.is_available() else "cpu"
    engine = make_engine(name, rollout_cfg.model_path, **engine_kwargs(rollout_cfg, device))
    reward = build_reward(trainer.reward_spec)
    worker_cfg = specs["trainer"]  # the trainer's TrainerWorkerConfig
    _, actor, critic = build_models(worker_cfg)
    rows, version = [], 0
    batches = trainer.dataset.batches(cfg.batch.rollout_batch_size, epoch=0)
    try:
        for step in range(args.warmup + args.steps):
            batch = next(batches)
            trainer.fleet_run.state.global_step = step
            t0 = time.perf_counter()
            completions = engine.generate([it.token_ids for it in batch], trainer.online_step.sampling())
            tensors = to_rollout_tensors(completions, engine.pad_token_id, engine.tokenizer)
            t1 = time.perf_counter()
            n = cfg.batch.group_size
            # the prompt and response texts the reward tier reads from the batch
            prompts = unpack_texts(tensors["prompt_text"], tensors["prompt_text_offsets"])
            texts = unpack_texts(tensors["response_text"], tensors["response_text_offsets"])
            metadata = [dict(batch[i // n].metadata) for i in range(len(completions))]
            scores = reward.score(prompts, texts, metadata).total
            t2 = time.perf_counter()
            settings = StepSettings.of(cfg, kl_coef=trainer.kl_coef)  # what the fleet sends with the step
            metrics = run_step(actor, critic, merge_batch(cfg.algorithm.name, [tensors]), scores, settings)
            t3 = time.perf_counter()
            version += 1
            for bucket in actor.iter_weight_buckets(int(cfg.weight_bucket_mb * 2**20)):
                engine.load_weights(bucket)
            engine.set_weight_version(version)
            t4 = time.perf_counter()
            rows.append({"step_s": t4 - t0, "generate": t1 - t0, "score": t2 - t1, "train": t3 - t2,
                         "publish": t4 - t3, "reward": statistics.fmean(scores),
                         "loss": metrics["loss"]})  # fmt: skip
    finally:
        engine.close()
    return rows[args.warmup :]


def median(rows: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3)


def main() -> int:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = Path("/tmp/rlfleet-step-overhead")
    inproc = in_process_steps(args, out)
    fleet = fleet_steps(args, out)
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]), "job": args.job, "overrides": args.overrides,
        "steps": args.steps, "warmup": args.warmup, "load_avg": list(os.getloadavg()),
        "in_process": {k: median(inproc, k) for k in ("step_s", *PHASES)},
        "fleet": {k: median(fleet, k) for k in ("step_s", *PHASES)},
        "rows": {"in_process": inproc, "fleet": fleet},
    }  # fmt: skip
    report["overhead"] = round(report["fleet"]["step_s"] / report["in_process"]["step_s"] - 1, 4)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| phase | in-process s | fleet s |\n| --- | --- | --- |")
    for key in ("step_s", *PHASES):
        print(f"| {key} | {report['in_process'][key]} | {report['fleet'][key]} |")
    print(f"overhead: {report['overhead']:+.1%} (target < +5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
