"""The SmolLM2 calculator job (issue 33, point 5): do tool use and accuracy rise on held-out problems?

    uv run --extra cpu python benchmarks/smollm2_calculator.py            # the job as committed (CPU)
    uv run --extra cpu python benchmarks/smollm2_calculator.py --smoke    # the tiny model, one step

Runs ``rlfleet train examples/smollm2_calculator.yaml`` as a user would (a subprocess: its own
nats-server, trainer, reward worker serving the ``calculator`` environment, rollout worker driving
the episodes), then reads what the run wrote: ``eval.json`` (the held-out problems, played greedily
as whole episodes before training, every ``eval.every`` steps and after: accuracy = the episode
reward = the share answered right, pass@1 from the answer check, the share of episodes that called
the calculator, turns) and ``metrics.jsonl`` (each step's training episodes: reward, tool use,
turns, step seconds). The JSON (``benchmarks/results/smollm2_calculator.json``) names the machine,
the command and the commit; the table compares held-out before and after.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import smoke  # noqa: E402  (this folder's helper module)

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "smollm2_calculator.yaml"
RESULTS = Path(__file__).parent / "results" / "smollm2_calculator.json"
SMOKE = {"smoke_overrides": True}
"""``--smoke``: the tiny character model on the tiny calculator data, one step, a few held-out prompts."""
TINY = [
    "model.name=tiny:digits", "model.mixed_precision=none", "data.path=examples/data/tiny_calc.jsonl",
    "data.system_prompt=null", "eval.data=examples/data/tiny_calc.jsonl", "eval.every=0", "eval.max_tokens=1",
    "max_steps=1", "max_prompt_length=32", "max_response_length=1", "batch.rollout_batch_size=2",
    "batch.train_batch_size=2", "batch.group_size=2",
]  # fmt: skip
STEP_KEYS = ("reward/mean", "episode/tool_use_frac", "episode/turns_mean", "time/step_s")
EVAL_KEYS = ("tool_use", "mean_turns", "pass@1", "mean_tokens")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--workdir", type=Path, default=None, help="where the run goes (default: a new temp folder)"
    )
    p.add_argument("--override", action="append", default=[], help="a job override (a.b=c), repeatable")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    p.set_defaults(smoke_overrides=False)
    return smoke.parse(p, argv, SMOKE)


def run_job(args: argparse.Namespace) -> tuple[Path, float, list[str]]:
    """Train the job into a fresh folder; its path, the wall seconds and the command."""
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rlfleet-bench-calculator-"))
    out = workdir / "run"
    if out.exists():
        raise SystemExit(f"{out} exists: remove it or give another --workdir")
    overrides = [*(TINY if args.smoke_overrides else []), *args.override, f"output_dir={out}"]
    command = [str(Path(sys.executable).parent / "rlfleet"), "train", str(JOB), *overrides]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, text=True, capture_output=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the job failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return out, seconds, command


def held_out(run: Path) -> list[dict[str, Any]]:
    """Each held-out evaluation of the run (label, step, accuracy and the episode figures)."""
    evals = []
    for line in (run / "eval.jsonl").read_text().splitlines():
        entry = json.loads(line)
        summary = entry["summary"]
        accuracy = next(iter(summary.get("rewards", {}).values()), None)
        evals.append({"label": entry["label"], "step": entry["step"], "accuracy": accuracy,
                      **{key: summary.get(key) for key in EVAL_KEYS}})  # fmt: skip
    return evals


def steps(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{"step": row["step"], **{key: row.get(key) for key in STEP_KEYS}} for row in rows]


def report(evals: list[dict[str, Any]], trained: list[dict[str, Any]]) -> None:
    print(f"{'held-out':>14}{'step':>6}{'accuracy':>10}{'tool use':>10}{'turns':>7}{'pass@1':>8}")
    for e in evals:
        cells = [e["accuracy"], e["tool_use"], e["mean_turns"], e["pass@1"]]
        shown = ["n/a" if v is None else f"{v:.3f}" for v in cells]
        print(f"{e['label']:>14}{e['step']:>6}{shown[0]:>10}{shown[1]:>10}{shown[2]:>7}{shown[3]:>8}")
    print(f"\n{'step':>6}{'reward':>8}{'tool use':>10}{'turns':>7}{'s':>7}")
    for r in trained:
        print(f"{r['step']:>6}{r['reward/mean']:>8.3f}{r['episode/tool_use_frac'] or 0:>10.3f}"
              f"{r['episode/turns_mean'] or 0:>7.2f}{r['time/step_s'] or 0:>7.1f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from async_pipeline import machine

    run, seconds, command = run_job(args)
    evals, trained = held_out(run), steps(run)
    report(evals, trained)
    before, after = evals[0], evals[-1]
    data = {
        "benchmark": "smollm2_calculator: held-out tool use and accuracy of the SmolLM2 calculator job",
        "job": str(JOB.relative_to(ROOT)), "overrides": command[3:-1], "wall_s": round(seconds, 1),
        "held_out": evals, "steps": trained,
        "rise": {key: [before.get(key), after.get(key)] for key in ("accuracy", "tool_use", "pass@1")},
        "machine": machine("cpu"), "command": " ".join(["python", *sys.argv]),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\n{seconds:.0f} s; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
