"""One GRPO loop on one GPU, colocated: vLLM rollout, the FSDP2 trainer and a rule reward, end to end.

    python3 benchmarks/gpu_grpo.py --jobs tiny,qwen2.5-0.5b --out $OUT/gpu_grpo.json   # a CUDA machine
    uv run --extra cpu python benchmarks/gpu_grpo.py --jobs tiny --device cpu          # the same, on CPU

Each job runs as a user runs it: ``rlfleet train job.yaml`` (the embedded launcher: a private
nats-server, the trainer, one vLLM rollout worker and the reward worker as processes). On CUDA the
rollout worker and the trainer share the GPU (``rollout.colocate: true``: vLLM sleeps at level 1
while the trainer steps) and weights move by CUDA IPC (``weight_carrier: auto`` picks it for a
worker on the trainer's GPU; the run's metrics count the workers that loaded that way).

Jobs:
- ``tiny``: ``examples/tiny_grpo.yaml`` (a character model learns to answer with digits);
- ``qwen2.5-0.5b``: a Qwen2.5-0.5B-shaped model (random init, bf16 weights, character
  tokenizer), 32 prompts x 8 samples of up to 256 tokens a step, the same charset reward.

Reported per job, medians over the steps after the first: the step's split (generate, score,
train, sync = publish + load), generated tokens/s, the reward's first and last value, and the
GPU's peak memory in use (``nvidia-smi``, every process on the card). ``benchmarks/rollout.py``
measures the rollout service against bare vLLM on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "gpu_grpo_h200.json"
SCRIPTS = {"rlfleet": "rlfleet.controller.cli", "rlfleet-rollout": "rlfleet.rollout.main",
           "rlfleet-reward": "rlfleet.reward.main", "rlfleet-trainer": "rlfleet.trainer.main"}  # fmt: skip
SPLIT = {"generate_s": "time/generate_s", "score_s": "time/score_s", "train_s": "time/train_s",
         "sync_s": "time/publish_s", "step_s": "time/step_s", "gen_tok_s": "throughput/gen_tok_s",
         "publish_s": "publish/trainer_s", "load_s": "rollout/load_s_max"}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", default="tiny,qwen2.5-0.5b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=0, help="override each job's max_steps (0: the job's)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rlfleet-gpu-grpo"))
    p.add_argument("--timeout", type=float, default=420.0, help="seconds one job may take")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def console_scripts(bin_dir: Path) -> None:
    """Put rlfleet's console scripts on PATH when the packages are importable but not installed
    (the GPU machine runs from ``PYTHONPATH``): the embedded launcher starts tiers by these names."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, module in SCRIPTS.items():
        if shutil.which(name):
            continue
        script = bin_dir / name
        script.write_text(
            f"#!{sys.executable}\nimport runpy\nrunpy.run_module({module!r}, run_name='__main__')\n"
        )
        script.chmod(0o755)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def write_prompts(path: Path, count: int) -> Path:
    """``count`` distinct digit prompts of 20-40 characters (the tiny job's task, longer)."""
    rows = []
    for i in range(count):
        digits = " ".join(str((i * 7 + k * 3) % 10) for k in range(8 + i % 8))
        rows.append(json.dumps({"prompt": f"copy {i}: {digits} ->"}))
    path.write_text("\n".join(rows) + "\n")
    return path


def job_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The job file of ``name`` for ``args.device`` (colocated vLLM on CUDA)."""
    out = args.workdir / name
    if name == "tiny":
        job = yaml.safe_load((ROOT / "examples" / "tiny_grpo.yaml").read_text())
        job["data"]["path"] = str(ROOT / job["data"]["path"])
        job["rollout"] = {"engine": "vllm", "gpu_memory_utilization": 0.15}
    elif name == "qwen2.5-0.5b":
        sys.path.insert(0, str(Path(__file__).parent))
        from colocated_sync import write_model

        model = out / "model"
        if not (model / "config.json").exists():
            write_model("qwen2.5-0.5b", model, seed=0)
        job = {
            "description": "GRPO on a Qwen2.5-0.5B-shaped model (random init), digits reward",
            "model": str(model), "reward": "charset:allowed=0123456789",
            "data": {"path": str(write_prompts(out / "prompts.jsonl", 512))},
            "max_prompt_length": 64,
            "num_epochs": 1, "max_steps": 8, "rollout_batch_size": 32, "train_batch_size": 32,
            "micro_batch_size": 32, "group_size": 8, "max_response_length": 256, "learning_rate": 1e-6,
            "kl_coef": 0.0, "temperature": 1.0, "seed": 0, "log_every": 1, "mixed_precision": "bf16",
            "weight_bucket_mb": 256,
            "rollout": {"engine": "vllm", "gpu_memory_utilization": 0.3, "max_cache_len": 512},
        }  # fmt: skip
    else:
        raise SystemExit(f"unknown job {name!r}")
    job.update(output_dir=str(out / "run"), device=args.device, loggers=["jsonl"], sample_table_size=0)
    job["rollout"].update(dtype="bfloat16" if args.device == "cuda" else "float32",
                          colocate=args.device == "cuda", enforce_eager=True)  # fmt: skip
    if args.steps:
        job["max_steps"] = args.steps
    return job


class GpuMemory:
    """The card's peak memory in use while the job runs (``nvidia-smi`` every 0.2 s, all processes)."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                text = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                self.peak_mib = max(self.peak_mib, int(text.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return
            self._stop.wait(0.2)

    def __enter__(self) -> GpuMemory:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def run_job(name: str, args: argparse.Namespace) -> dict[str, Any]:
    job = job_config(name, args)
    run_dir = Path(job["output_dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    job_path = args.workdir / f"{name}.yaml"
    job_path.write_text(yaml.safe_dump(job, sort_keys=False))
    t0 = time.perf_counter()
    with GpuMemory() as memory:
        proc = subprocess.run(["rlfleet", "train", str(job_path)], capture_output=True, text=True,
                              timeout=args.timeout)  # fmt: skip
    wall = time.perf_counter() - t0
    log = (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] if (
        run_dir / "metrics.jsonl").exists() else []  # fmt: skip
    result: dict[str, Any] = {"job": job, "exit_code": proc.returncode, "wall_s": round(wall, 1),
                              "steps": len(rows), "peak_gpu_mib": memory.peak_mib or None}  # fmt: skip
    if proc.returncode != 0 or not rows:
        result["log_tail"] = log
        return result
    timed = rows[1:] or rows
    for key, metric in SPLIT.items():
        values = [r[metric] for r in timed if metric in r]
        if values:
            result[key] = round(statistics.median(values), 4)
    result["ipc_workers"] = rows[-1].get("publish/ipc_workers")
    result["reward_first"] = rows[0].get("reward/mean")
    result["reward_last"] = rows[-1].get("reward/mean")
    result["per_step"] = [{k: round(r[m], 4) for k, m in SPLIT.items() if m in r} for r in rows]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    console_scripts(args.workdir / "bin")
    report: dict[str, Any] = {
        "benchmark": "gpu_grpo",
        "device": args.device,
        "python": sys.version.split()[0],
        "command": " ".join([sys.executable, *sys.argv]),
        "jobs": {},
    }
    if args.device == "cuda":
        import torch
        import vllm

        report.update(device=torch.cuda.get_device_name(0), torch=torch.__version__, vllm=vllm.__version__)
    failed = False
    for name in args.jobs.split(","):
        try:
            report["jobs"][name] = run_job(name, args)
        except subprocess.TimeoutExpired as exc:
            report["jobs"][name] = {"error": f"timed out after {exc.timeout} s"}
        result = report["jobs"][name]
        failed = failed or result.get("exit_code") != 0
        print(name, json.dumps({k: v for k, v in result.items() if k not in ("job", "per_step")}), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(report, indent=2) + "\n"
        )  # after every job: a later one may not finish
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
