"""LoRA against full training on the main job (issue 32), in one invocation, on CPU.

    uv run --extra cpu python benchmarks/lora.py                  # SmolLM2-135M-Instruct, 6 steps each
    uv run --extra cpu python benchmarks/lora.py --smoke          # the tiny digits job, 2 steps each

Each side is ``rlfleet train examples/smollm2_concise.yaml`` (the README's first command), its own
process tree, one after the other: ``full`` as shipped, ``lora`` with ``model.lora`` (``--rank``,
alpha twice the rank, every attention and MLP linear layer) at ``--lora-lr``. Per side: median
s/step (the first step left out), the trainer's update seconds, peak RSS summed over the process
tree (sampled, ``tree_memory.py``), and the held-out evaluation before and after (``eval.json``:
mean words, share within 50 words, similarity), with whether the README's target was reached (mean
<= 50 words, >= 80% within 50, similarity within 10% of the base). The JSON names the machine.
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
from tree_memory import GIB, TreeMemory  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "lora_cpu.json"
BIN = Path(sys.executable).parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", default="smollm2_concise", help="examples/<job>.yaml")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-lr", type=float, default=1e-3, help="LoRA's learning rate (full: the job's)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one side may take")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rlfleet-lora"))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    return smoke.parse(
        p, argv, {"job": "tiny_grpo", "steps": 2, "rank": 4, "lora_lr": 5e-2, "timeout": 300.0}
    )


def run_side(name: str, args: argparse.Namespace) -> dict[str, Any]:
    out = args.workdir / name
    overrides = [f"max_steps={args.steps}", f"output_dir={out}", "log_every=1", "loggers=[jsonl]"]
    if name == "lora":
        overrides += [f"model.lora.rank={args.rank}", f"model.lora.alpha={2.0 * args.rank}",
                      f"update.learning_rate={args.lora_lr}"]  # fmt: skip
    command = [str(BIN / "rlfleet"), "train", str(ROOT / "examples" / f"{args.job}.yaml"), *overrides]
    started = time.time()
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        with TreeMemory(proc.pid, interval=0.5, pss_every=0.0) as memory:
            try:
                output, _ = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
    side: dict[str, Any] = {"command": " ".join(command[1:]), "exit_code": proc.returncode,
                            "wall_s": round(time.time() - started, 1),
                            "peak_rss_gib": round(memory.peak_rss / GIB, 2)}  # fmt: skip
    metrics = out / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        return {**side, "log_tail": output[-2000:]}
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    timed = rows[1:] or rows
    side.update({
        "steps": len(rows), "s_per_step": round(statistics.median(r["time/step_s"] for r in timed), 2),
        "update_s": round(statistics.median(r["time/update_s"] for r in timed), 3),
        "reward_first": round(rows[0]["reward/mean"], 3), "reward_last": round(rows[-1]["reward/mean"], 3),
    })  # fmt: skip
    evaluated = out / "eval.json"
    if evaluated.exists():
        side["heldout"] = heldout(json.loads(evaluated.read_text()))
    return side


def heldout(report: dict[str, Any]) -> dict[str, Any]:
    """Before and after, and whether the README's target was reached (when the job has held-out data)."""
    points = {k: report[k] for k in ("before", "after") if isinstance(report.get(k), dict)}
    figures = {
        k: {
            "mean_words": v.get("mean_words"),
            "within_limit": v.get("within_limit"),
            "similarity": v.get("similarity", v.get("relevance")),
        }  # an older eval.json says relevance
        for k, v in points.items()
    }
    before, after = figures.get("before", {}), figures.get("after", {})
    if all(isinstance(d.get(m), (int, float)) for d in (before, after) for m in ("mean_words", "similarity")):
        figures["target_reached"] = (after["mean_words"] <= 50 and (after.get("within_limit") or 0) >= 0.8
                                     and after["similarity"] >= 0.9 * before["similarity"])  # fmt: skip
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"job": args.job, "steps": args.steps, "rank": args.rank,
                              "lora_lr": args.lora_lr, "machine": machine("cpu"),
                              "command": " ".join(["python", *sys.argv]), "sides": {}}  # fmt: skip
    for name in ("full", "lora"):
        print(f"running {name} ...", flush=True)
        report["sides"][name] = run_side(name, args)
    print("| | " + " | ".join(report["sides"]) + " |")
    print("| --- |" + " --- |" * len(report["sides"]))
    for key in (
        "s_per_step",
        "update_s",
        "peak_rss_gib",
        "reward_first",
        "reward_last",
        "heldout",
        "exit_code",
    ):
        print(f"| {key} | " + " | ".join(str(s.get(key)) for s in report["sides"].values()) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if any(s.get("exit_code") != 0 for s in report["sides"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
