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
colocated engines do, unless ``--sleep-level 0`` keeps it awake so that it generates while the trainer
trains). The table is printed, the JSON names the machine; ``--plot`` draws the
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
    p.add_argument(
        "--seeds",
        help="run every side once per seed (comma-separated): the synchronous "
        "loop's run-to-run noise, against which the pipelined reward curves are judged",
    )
    p.add_argument("--partial-tokens", type=int, default=0, help="also run max_staleness 1 with partial "
                   "rollouts in segments of this many tokens (0: not run)")  # fmt: skip
    p.add_argument(
        "--sleep-level",
        type=int,
        choices=(0, 1, 2),
        help="CUDA: the colocated engine's sleep_level (0: stays awake while the trainer steps)",
    )
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

    try:  # the GPU machine's copy of the tree may have no git
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    except OSError:
        commit = ""
    return {**host(device), "cores": len(os.sched_getaffinity(0)), "commit": commit.strip()}


def side_args(args: argparse.Namespace, k: int, partial: int = 0) -> argparse.Namespace:
    """The arguments :func:`gpu_grpo.run_job` reads, for the side of ``max_staleness`` ``k`` (with
    partial rollouts in segments of ``partial`` tokens)."""
    folder = f"staleness-{k}" + (f"-partial-{partial}" if partial else "")
    return argparse.Namespace(device=args.device, workdir=args.workdir / folder, eager=False,
                              steps=args.steps, lr=args.lr, micro_batch=0, max_staleness=k,
                              seed=args.seed, sleep_level=args.sleep_level,
                              partial_rollout_tokens=partial)  # fmt: skip


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
        "token_staleness_max": max(r.get("rollout/token_staleness_max", 0.0) for r in rows),
        "mixed_version_frac": round(
            statistics.fmean(r.get("rollout/mixed_version_frac", 0.0) for r in rows), 3
        ),
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


def reward_noise(sides: dict[str, Any], kinds: dict[str, list[str]]) -> dict[str, Any]:
    """Reward against samples seen, judged against the synchronous loop's run-to-run noise: per step,
    the band of the synchronous runs' rewards (min to max over the seeds) and each kind's mean over
    the seeds; the share of steps where that mean lies inside the band; the final reward (mean of the
    last 5 steps) of each kind, mean and spread over the seeds."""
    curves = {kind: [[r for _, r in sides[n].get("reward_by_samples") or []] for n in names]
              for kind, names in kinds.items()}  # fmt: skip
    steps = min(len(c) for runs in curves.values() for c in runs)
    samples = [x for x, _ in sides[kinds["synchronous"][0]]["reward_by_samples"][:steps]]
    sync = curves["synchronous"]
    low = [min(run[i] for run in sync) for i in range(steps)]
    high = [max(run[i] for run in sync) for i in range(steps)]
    out: dict[str, Any] = {"samples": samples, "synchronous_band": [low, high], "mean": {}, "summary": {}}
    for kind, runs in curves.items():
        mean = [statistics.fmean(run[i] for run in runs) for i in range(steps)]
        finals = [statistics.fmean(run[steps - 5 : steps]) for run in runs]
        inside = sum(lo <= m <= hi for lo, m, hi in zip(low, mean, high, strict=True)) / steps
        out["mean"][kind] = [round(m, 4) for m in mean]
        out["summary"][kind] = {
            "final_reward_mean": round(statistics.fmean(finals), 4),
            "final_reward_spread": round(max(finals) - min(finals), 4),
            "steps_within_sync_band": round(inside, 3), "seeds": len(runs),
        }  # fmt: skip
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    noise = report.get("noise")
    if noise:  # several seeds: the synchronous band, and each kind's mean over the seeds
        low, high = noise["synchronous_band"]
        ax.fill_between(noise["samples"], low, high, alpha=0.25, label="synchronous, min-max over seeds")
        for kind, mean in noise["mean"].items():
            ax.plot(noise["samples"], mean, marker="o", markersize=3, label=f"{kind} (mean)")
    for name, side in [] if noise else report["sides"].items():
        points = side.get("reward_by_samples") or []
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xlabel("samples seen")
    ax.set_ylabel("mean reward of the step")
    ax.set_title(f"{report['job']}: synchronous vs pipelined ({report['machine'].get('gpu') or 'CPU'})")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu_grpo.console_scripts(args.workdir / "bin")  # the children find rlfleet's commands on PATH
    sides = [(int(k), 0) for k in args.staleness.split(",")]
    if args.partial_tokens:
        sides.append((1, args.partial_tokens))
    seeds: list[int | None] = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    report: dict[str, Any] = {"job": args.job, "device": args.device, "machine": machine(args.device),
                              "command": " ".join(["python", *sys.argv]), "sides": {}}  # fmt: skip
    kinds: dict[str, list[str]] = {}
    for seed, (k, partial) in ((seed, side) for seed in seeds for side in sides):
        kind = "synchronous" if k == 0 else f"max_staleness {k}" + (f", partial {partial}" if partial else "")
        name = kind if len(seeds) == 1 else f"{kind}, seed {seed}"
        kinds.setdefault(kind, []).append(name)
        print(f"running {args.job}: {name} ...", flush=True)
        args.seed = seed
        sub = side_args(args, k, partial)
        sub.workdir = sub.workdir.with_name(sub.workdir.name + (f"-seed-{seed}" if len(seeds) > 1 else ""))
        sub.workdir.mkdir(parents=True, exist_ok=True)
        result = gpu_grpo.run_job(args.job, sub, args.timeout)
        side = {"max_staleness": k, "partial_rollout_tokens": partial, "seed": seed,
                "exit_code": result.get("exit_code"),
                "wall_s": result.get("wall_s"), "steps": result.get("steps"),
                "peak_gpu_mib": result.get("peak_gpu_mib"), **figures(result),
                "step_end_s": result.get("step_end_s")}  # fmt: skip
        if result.get("error") or result.get("exit_code") != 0:
            side["log_tail"] = result.get("log_tail", "")[-2000:]
        if result.get("evals") and args.job == "smollm2-concise":
            side["heldout"] = heldout(result, result["job"])
        side["rows"] = result.get("rows")
        report["sides"][name] = side
    for side in report["sides"].values():  # against the first side of the same seed
        base = next(b for b in report["sides"].values() if b["seed"] == side["seed"])
        if base.get("s_per_step") and side.get("s_per_step"):
            side["speedup"] = round(base["s_per_step"] / side["s_per_step"], 3)
    if len(seeds) > 1:
        report["noise"] = reward_noise(report["sides"], kinds)
        print(json.dumps(report["noise"]["summary"], indent=1))
    keys = ("s_per_step", "speedup", "trainer_idle_share", "fleet_idle_share", "tokens_per_s_of_run",
            "staleness_max", "token_staleness_max", "mixed_version_frac", "over_bound", "reward_last",
            "peak_gpu_mib", "wall_s")  # fmt: skip
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
