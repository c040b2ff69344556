"""Launch cost: time from command to first step, and per-step time, embedded launcher against Ray.

    uv run --extra cpu python benchmarks/launch.py                      # 6 steps, each launcher once
    uv run --extra cpu python benchmarks/launch.py --steps 8 --repeats 2
    uv run --extra cpu python benchmarks/launch.py --quick              # 3 steps, one repeat
    uv run --extra cpu python benchmarks/launch.py --smoke              # 2 steps, one repeat (CI's check)

Each run is the real CLI, ``rlfleet train <job> launcher.type=<name>``, as a subprocess (the venv's
``rlfleet`` script, no ``uv run`` in the timing), with ``max_steps``, a fresh ``output_dir`` and
only the jsonl logger. ``metrics.jsonl`` stamps every step line with the time the step ended, so:
time to first step = first line's ``time`` - the moment the command was started; per-step = the
gaps between consecutive lines from step 2 on (steps 2..N, the first step also pays warm-up) and the
controller's own ``time/step_s`` for the same steps; total = command start to process exit (this
includes shutting the fleet down). The Ray run starts its own local Ray (``launcher.num_cpus``), so its
time to first step includes ``ray.init``. Results: ``benchmarks/results/launch.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import smoke

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "launch.json"
BIN = Path(sys.executable).parent
LAUNCHERS = ("embedded", "ray")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", default="examples/tiny_grpo.yaml", help="job file, as for rlfleet train")
    p.add_argument("--steps", type=int, default=6, help="max_steps of every run")
    p.add_argument("--repeats", type=int, default=1, help="runs per launcher (interleaved)")
    p.add_argument("--ray-num-cpus", type=int, default=4, help="logical CPUs of the run's local Ray")
    p.add_argument("--quick", action="store_true", help="3 steps, one repeat")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("overrides", nargs="*", help="key=value job overrides, for both launchers")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = smoke.parse(p, None, {"steps": 2, "repeats": 1, "timeout": 180.0})
    if args.quick:
        args.steps, args.repeats = 3, 1
    if args.steps < 2:
        p.error("--steps must be at least 2 (per-step time is taken over steps 2..N)")
    return args


def run_once(args: argparse.Namespace, launcher: str, workdir: Path) -> dict[str, Any]:
    """One ``rlfleet train`` run; its timings from the wall clock and its ``metrics.jsonl``."""
    out = workdir / "run"
    overrides = [f"launcher.type={launcher}", f"max_steps={args.steps}", f"output_dir={out}",
                 "loggers=[jsonl]", "sample_table_size=0", "save_every=0", *args.overrides]  # fmt: skip
    if launcher == "ray":
        overrides.append(f"launcher.num_cpus={args.ray_num_cpus}")
    # Ray 2.60 may ask for token auth; a throwaway local Ray needs none. No uv runtime-env hook:
    # the workers use this venv as it is.
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1",
           "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_AUTH_MODE": "disabled"}  # fmt: skip
    cmd = [str(BIN / "rlfleet"), "train", args.job, *overrides]
    log = workdir / "train.log"
    start = time.time()
    with log.open("w") as sink:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                              timeout=args.timeout, check=False)  # fmt: skip
    end = time.time()
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    rows = [json.loads(line) for line in lines if line.strip()]
    if proc.returncode != 0 or len(rows) < args.steps:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{launcher} run failed (rc {proc.returncode}, {len(rows)} steps):\n{tail}")
    stamps = [r["time"] for r in rows]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    step_s = [r["time/step_s"] for r in rows[1:] if "time/step_s" in r]
    return {
        "launcher": launcher, "steps": len(rows), "first_step_s": round(stamps[0] - start, 3),
        "gap_mean_s": round(statistics.fmean(gaps), 3), "gap_median_s": round(statistics.median(gaps), 3),
        "step_s_mean": round(statistics.fmean(step_s), 3) if step_s else None,
        "step_s_median": round(statistics.median(step_s), 3) if step_s else None,
        "total_s": round(end - start, 3), "shutdown_s": round(end - stamps[-1], 3),
        "reward_first": rows[0].get("reward/mean"), "reward_last": rows[-1].get("reward/mean"),
    }  # fmt: skip


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over a launcher's repeats."""
    keys = (
        "first_step_s",
        "gap_mean_s",
        "gap_median_s",
        "step_s_mean",
        "step_s_median",
        "total_s",
        "shutdown_s",
    )
    return {
        k: round(statistics.median(r[k] for r in runs), 3)
        for k in keys
        if all(r[k] is not None for r in runs)
    }


def machine() -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return {"cpu_count": os.cpu_count(), "load_avg_start": [round(x, 2) for x in os.getloadavg()],
            "git_commit": commit, "python": sys.version.split()[0]}  # fmt: skip


def main() -> int:
    args = parse_args()
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]), "job": args.job, "steps": args.steps,
        "repeats": args.repeats, "overrides": args.overrides, "machine": machine(),
    }  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in LAUNCHERS}
    for _ in range(args.repeats):
        for name in LAUNCHERS:  # interleaved, so a load swing hits both
            with tempfile.TemporaryDirectory(
                prefix="rlb-", dir="/tmp", ignore_cleanup_errors=True
            ) as tmp:  # short: Ray's socket paths
                runs[name].append(run_once(args, name, Path(tmp)))
            print(f"{name}: {runs[name][-1]}", flush=True)
    load = os.getloadavg()
    report["machine"]["load_avg_end"] = [round(x, 2) for x in load]
    report["summary"] = {name: summary(rs) for name, rs in runs.items()}
    report["runs"] = runs
    m = report["machine"]
    report["note"] = (
        f"Measured on a shared {os.cpu_count()}-core machine with other work running (load average"
        f" {m['load_avg_start']} at start, {m['load_avg_end']} at end): wall-clock figures swing from"
        " run to run; compare the two launchers within this run, not the absolute numbers."
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| launcher | first step s | per-step mean s | per-step median s | time/step_s median | total s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, s in report["summary"].items():
        print(f"| {name} | {s['first_step_s']} | {s['gap_mean_s']} | {s['gap_median_s']} "
              f"| {s.get('step_s_median')} | {s['total_s']} |")  # fmt: skip
    print(f"note: {report['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
