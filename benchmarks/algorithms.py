"""The policy-gradient recipes side by side (issue 31): GRPO, Dr. GRPO, DAPO, GSPO and CISPO on the same
job and seed, in one invocation.

    uv run --extra cpu python benchmarks/algorithms.py                  # the tiny digits task, 36 steps each
    uv run --extra cpu python benchmarks/algorithms.py --smoke          # 2 steps of two sides (CI's check)

Each side is ``rlfleet train`` on its example job (``examples/tiny_grpo.yaml``, ``dr_grpo_tiny.yaml``,
``dapo_tiny.yaml``, ``gspo_tiny.yaml``; CISPO is ``tiny_grpo.yaml`` with ``update.policy_loss=cispo``,
its weights clipped above at 1.28 and unbounded below; ``grpo_dynamic`` is GRPO with DAPO's dynamic
sampling alone), its own process tree, one after the other,
with the same seed and prompts. Per side, from its ``metrics.jsonl``: reward against samples seen and
against wall time (from the command's start), samples and seconds to a mean step reward of
``--target`` (samples generated, those dynamic sampling dropped included; the reward is the mean
over them too), the last 5 steps' mean reward, tokens generated, and the tokens spent on groups
whose rewards were all equal (``groups/wasted_token_frac``: no group-relative signal, trained or
dropped), groups generated, trained and flat, and batches generated. The table is
printed; the JSON names the machine; ``--plot`` overlays the runs (reward against samples, and
against seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import smoke  # noqa: E402  (this folder's helper modules)
from async_pipeline import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "algorithms.json"
BIN = Path(sys.executable).parent
SIDES: dict[str, tuple[str, list[str]]] = {
    "grpo": ("tiny_grpo", []),
    "dr_grpo": ("dr_grpo_tiny", []),
    "dapo": ("dapo_tiny", []),
    "grpo_dynamic": ("tiny_grpo", ["dynamic_sampling.enabled=true", "num_epochs=12"]),
    "gspo": ("gspo_tiny", []),
    "cispo": ("tiny_grpo", ["update.policy_loss=cispo", "update.clip_eps=1.0", "update.clip_eps_high=0.28"]),
}
"""Side -> (its example job, the overrides that make it that side)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sides", default=",".join(SIDES), help=f"any of {', '.join(SIDES)}")
    p.add_argument("--steps", type=int, default=36, help="training steps of each side")
    p.add_argument("--seed", type=int, default=0, help="placement.seed of every side")
    p.add_argument("--target", type=float, default=0.9, help="the mean step reward the run is timed to")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one side may take")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rlfleet-algorithms"))
    p.add_argument("--out", type=Path, default=RESULTS, help="result JSON")
    p.add_argument("--plot", type=Path, help="the runs overlaid (PNG)")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = smoke.parse(p, argv, {"sides": "grpo,gspo", "steps": 2, "timeout": 300.0})
    unknown = set(args.sides.split(",")) - set(SIDES)
    if unknown:
        p.error(f"unknown sides {sorted(unknown)}: any of {', '.join(SIDES)}")
    return args


def run_side(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One side's run to the end; its rows, or the end of its log when it failed."""
    job, extra = SIDES[name]
    out = args.workdir / name
    overrides = [f"max_steps={args.steps}", f"output_dir={out}", f"placement.seed={args.seed}", "log_every=1",
                 "loggers=[jsonl]", "sample_table_size=0", *extra]  # fmt: skip
    command = [str(BIN / "rlfleet"), "train", str(ROOT / "examples" / f"{job}.yaml"), *overrides]
    started = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    side: dict[str, Any] = {"command": " ".join(command[1:]), "exit_code": done.returncode,
                            "wall_s": round(time.time() - started, 1)}  # fmt: skip
    metrics = out / "metrics.jsonl"
    if done.returncode != 0 or not metrics.exists():
        side["log_tail"] = (done.stdout + done.stderr)[-2000:]
        return side
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {**side, **figures(rows, started, args.target)}


def figures(rows: list[dict[str, Any]], started: float, target: float) -> dict[str, Any]:
    """A side's curves and summary from its steps' metrics (``started``: the command's start)."""
    seen, tokens, wasted, curve = 0.0, 0.0, 0.0, []
    reached: dict[str, Any] = {"step": None, "samples": None, "seconds": None}
    kept = flat = groups = 0.0
    for row in rows:
        samples = row["rollout/samples"]  # every sample generated, with dynamic sampling the dropped too
        seen += samples
        generated = row["throughput/gen_tok_s"] * row["time/generate_s"]
        tokens += generated
        wasted += generated * row.get("groups/wasted_token_frac", 0.0)  # step-wide with dynamic sampling
        groups += row.get("groups/generated", row.get("groups/total", 0.0))
        kept += row.get("groups/kept", row.get("groups/total", 0.0))
        flat += row.get("groups/dropped_flat", 0.0) + row.get("groups/flat", 0.0)
        curve.append({"step": row["step"], "samples": seen, "seconds": round(row["time"] - started, 2),
                      "reward": round(row["reward/mean"], 4)})  # fmt: skip
        if reached["step"] is None and row["reward/mean"] >= target:
            reached = {"step": row["step"], "samples": seen, "seconds": curve[-1]["seconds"]}
    last = [row["reward/mean"] for row in rows[-5:]]
    return {
        "steps": len(rows), "final_reward": round(statistics.fmean(last), 4), "target_reached": reached,
        "tokens_generated": round(tokens), "tokens_wasted": round(wasted),
        "wasted_share": round(wasted / tokens, 3) if tokens else None,
        "groups": groups, "groups_trained": kept, "flat_groups": flat,
        "batches_generated": sum(row.get("rollout/batches_generated", 1.0) for row in rows),
        "s_per_step": round(statistics.median(r["time/step_s"] for r in rows[1:] or rows), 3),
        "curve": curve,
    }  # fmt: skip


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_samples, by_seconds) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for name, side in report["sides"].items():
        curve = side.get("curve") or []
        by_samples.plot([p["samples"] for p in curve], [p["reward"] for p in curve], label=name)
        by_seconds.plot([p["seconds"] for p in curve], [p["reward"] for p in curve], label=name)
    by_samples.set_xlabel("samples seen")
    by_seconds.set_xlabel("seconds from the command")
    by_samples.set_ylabel("mean reward of the step")
    by_samples.legend()
    fig.suptitle(f"{report['job']}: policy-gradient recipes, seed {report['seed']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"job": "tiny digits", "seed": args.seed, "steps": args.steps,
                              "target": args.target, "machine": machine("cpu"),
                              "command": " ".join(["python", *sys.argv]), "sides": {}}  # fmt: skip
    for name in args.sides.split(","):
        print(f"running {name} ...", flush=True)
        report["sides"][name] = run_side(name, args)
    keys = ("final_reward", "target_reached", "s_per_step", "tokens_generated", "tokens_wasted",
            "wasted_share", "groups", "groups_trained", "flat_groups", "batches_generated", "wall_s",
            "exit_code")  # fmt: skip
    print("| | " + " | ".join(report["sides"]) + " |")
    print("| --- |" + " --- |" * len(report["sides"]))
    for key in keys:
        print(f"| {key} | " + " | ".join(str(s.get(key)) for s in report["sides"].values()) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.plot:
        plot(report, args.plot)
    return 1 if any(s.get("exit_code") != 0 for s in report["sides"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
