"""Rollout and training in parallel (issue 30): the synchronous loop against ``max_staleness`` k,
same job and seed, in one invocation.

    uv run --extra cpu python benchmarks/async_pipeline.py                    # the main job on CPU: 0, 1, 2
    python3 benchmarks/async_pipeline.py --device cuda --job qwen2.5-0.5b     # on a GPU machine (gpu/README)
    uv run --extra cpu python benchmarks/async_pipeline.py --smoke            # tiny, 2 steps (CI's check)

Each side is ``rlfleet train`` on the job of :mod:`gpu_grpo` (``smollm2-concise``: the main job,
held-out evaluation after every step; ``qwen2.5-0.5b``: a speed job on a 0.5B-shaped model; ``tiny``)
with ``max_staleness`` set, in its own process tree. Per side: s/step (median of steps 2..N), the
trainer's idle share (the part of the steps' wall time it was not training or publishing: waiting
for its batch, or for the workers' loads), the fleet's idle share (the part of the run's step time
during which no batch was being generated), generated tokens/s, the staleness recorded by every
step, reward against samples seen, and (the main job) the held-out words, share within the limit
and relevance after each step with the wall time to the held-out target. On CUDA the card's peak
memory too (the engine and the trainer share it; the engine sleeps between its generate calls, as
colocated engines do). The table is printed, the JSON names the machine; ``--plot`` draws the
reward-vs-samples curves of every side on one plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import gpu_grpo  # noqa: E402  (this folder's helper modules)
import smoke  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "async_pipeline_cpu.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", default="smollm2-concise", choices=gpu_grpo.JOBS, help="the job every side runs")
    p.add_argument("--staleness", default="0,1,2", help="the sides: max_staleness values (0: synchronous)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=0, help="override the job's max_steps (0: the job's)")
    p.add_argument("--lr", type=float, default=0.0, help="override the job's learning rate (0: the job's)")
    p.add_argument("--seed", type=int, help="override the job's placement.seed (sampling and data order)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one side may take")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rlfleet-async-pipeline"))
    p.add_argument("--out", type=Path, default=RESULTS, help="result JSON")
    p.add_argument("--plot", type=Path, help="reward against samples seen, every side on one plot (PNG)")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    return smoke.parse(p, argv, {"job": "tiny", "staleness": "0,1", "steps": 2, "timeout": 180.0})


def machine(device: str) -> dict[str, Any]:
    """:func:`rollout.machine` (CPU model and flags, GPU, versions), with the cores this run may use and
    the commit."""
    import os

    from rollout import machine as host

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {**host(device), "cores": len(os.sched_getaffinity(0)), "commit": commit.strip()}


def side_args(args: argparse.Namespace, k: int) -> argparse.Namespace:
    """The arguments :func:`gpu_grpo.run_job` reads, for the side of ``max_staleness`` ``k``."""
    return argparse.Namespace(device=args.device, workdir=args.workdir / f"staleness-{k}", eager=False,
                              steps=args.steps, lr=args.lr, micro_batch=0, max_staleness=k,
                              seed=args.seed)  # fmt: skip


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """A side's figures from its steps' metrics."""
    rows = result.get("rows") or []
    if not rows:
        return {}
    timed = rows[1:] or rows
    step_s = statistics.median(r["time/step_s"] for r in timed)
    wall = sum(r["time/step_s"] for r in timed)
    train = sum(r["time/train_s"] + r.get("publish/trainer_s", 0.0) for r in timed)
    generating = sum(min(r["time/generate_s"], r["time/step_s"]) for r in timed)  # one batch at a time
    tokens = sum(r["rollout/samples"] * r.get("response_length", 0.0) for r in rows)
    samples, seen = [], 0.0
    for r in rows:
        seen += r["rollout/samples"]
        samples.append(seen)
    return {
        "s_per_step": round(step_s, 3),
        "trainer_idle_share": round(max(0.0, 1 - train / wall), 3),
        "fleet_idle_share": round(max(0.0, 1 - generating / wall), 3),
        "gen_tok_s": round(statistics.median(r["throughput/gen_tok_s"] for r in timed), 1),
        "tokens_per_s_of_run": round(tokens / max(sum(r["time/step_s"] for r in rows), 1e-9), 1),
        "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in rows),
        "staleness_mean": round(statistics.fmean(r.get("rollout/staleness_mean", 0.0) for r in rows), 3),
        "over_bound": sum(r.get("rollout/staleness_over_bound", 0.0) for r in rows),
        "reward_by_samples": [[s, round(r["reward/mean"], 4)] for s, r in zip(samples, rows, strict=True)],
        "reward_last": round(rows[-1]["reward/mean"], 4),
    }


def heldout(result: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """The main job's held-out answers measured (:mod:`heldout_targets`), after each step; the
    step and the wall time from the command at which the target first held."""
    from heldout_targets import concise_target, first_step_meeting, rescore

    evals = rescore(result["evals"], ROOT / "examples" / "data" / Path(job["eval"]["data"]).name,
                    job["eval"].get("limit_words", 50))  # fmt: skip
    first, last = evals[0]["summary"], evals[-1]["summary"]
    step = first_step_meeting(evals)
    ends = result.get("step_end_s", [])
    keep = ("mean_words", "within_limit", "relevance")
    return {
        "by_step": [{"label": e["label"], **{k: round(e["summary"][k], 4) for k in keep}} for e in evals],
        "target_after": concise_target(last, first), "target_step": step,
        "time_to_target_s": ends[step - 1] if step and len(ends) >= step else None,
    }  # fmt: skip


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, side in report["sides"].items():
        points = side.get("reward_by_samples") or []
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xlabel("samples seen")
    ax.set_ylabel("mean reward of the step")
    ax.set_title(f"{report['job']}: synchronous vs pipelined ({report['machine'].get('gpu', 'CPU')})")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu_grpo.console_scripts(args.workdir / "bin")  # the children find rlfleet's commands on PATH
    sides = [int(k) for k in args.staleness.split(",")]
    report: dict[str, Any] = {"job": args.job, "device": args.device, "machine": machine(args.device),
                              "command": " ".join(["python", *sys.argv]), "sides": {}}  # fmt: skip
    for k in sides:
        name = "synchronous" if k == 0 else f"max_staleness {k}"
        print(f"running {args.job} with max_staleness {k} ...", flush=True)
        sub = side_args(args, k)
        sub.workdir.mkdir(parents=True, exist_ok=True)
        result = gpu_grpo.run_job(args.job, sub, args.timeout)
        side = {"max_staleness": k, "exit_code": result.get("exit_code"), "wall_s": result.get("wall_s"),
                "steps": result.get("steps"), "peak_gpu_mib": result.get("peak_gpu_mib"), **figures(result),
                "step_end_s": result.get("step_end_s")}  # fmt: skip
        if result.get("error") or result.get("exit_code") != 0:
            side["log_tail"] = result.get("log_tail", "")[-2000:]
        if result.get("evals") and args.job == "smollm2-concise":
            side["heldout"] = heldout(result, result["job"])
        side["rows"] = result.get("rows")
        report["sides"][name] = side
    base = next(iter(report["sides"].values()))
    for side in report["sides"].values():
        if base.get("s_per_step") and side.get("s_per_step"):
            side["speedup"] = round(base["s_per_step"] / side["s_per_step"], 3)
    keys = ("s_per_step", "speedup", "trainer_idle_share", "fleet_idle_share", "tokens_per_s_of_run",
            "staleness_max", "over_bound", "reward_last", "peak_gpu_mib", "wall_s")  # fmt: skip
    print("| | " + " | ".join(report["sides"]) + " |")
    print("| --- |" + " --- |" * len(report["sides"]))
    for key in keys:
        print(f"| {key} | " + " | ".join(str(s.get(key)) for s in report["sides"].values()) + " |")
    for name, side in report["sides"].items():
        held = side.get("heldout")
        if held:
            print(name, "held out:", held["by_step"][0], "->", held["by_step"][-1],
                  "target step", held["target_step"], "at", held["time_to_target_s"], "s")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.plot:
        plot(report, args.plot)
    failed = [n for n, s in report["sides"].items() if s.get("exit_code") != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
