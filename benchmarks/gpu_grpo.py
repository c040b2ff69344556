"""One GRPO loop on one GPU, colocated: vLLM rollout, the FSDP2 trainer and a rule reward, end to end.

    python3 benchmarks/gpu_grpo.py --jobs tiny,qwen2.5-0.5b --out $OUT/gpu_grpo.json   # a CUDA machine
    uv run --extra cpu python benchmarks/gpu_grpo.py --jobs tiny --device cpu          # the same, on CPU
    uv run --extra cpu python benchmarks/gpu_grpo.py --smoke      # tiny on CPU, 1 step (CI's check)

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
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).parent))
import smoke  # noqa: E402  (this folder's helper modules)
from gpu_memory import GpuMemory  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "gpu_grpo_h200.json"
SCRIPTS = {"rlfleet": "rlfleet.controller.cli", "rlfleet-rollout": "rlfleet.rollout.main",
           "rlfleet-reward": "rlfleet.reward.main", "rlfleet-trainer": "rlfleet.trainer.main"}  # fmt: skip
JOBS = ("tiny", "smollm2-concise", "numeric", "qwen2.5-0.5b")
NUMERIC_HELDOUT = "examples/data/arith_words_test.jsonl"
PHASES = ("generate_s", "score_s", "train_s", "sync_s")
SPLIT = {"generate_s": "time/generate_s", "score_s": "time/score_s", "train_s": "time/train_s",
         "sync_s": "time/publish_s", "step_s": "time/step_s", "gen_tok_s": "throughput/gen_tok_s",
         "publish_s": "publish/trainer_s", "load_s": "rollout/load_s_max",
         "update_s": "time/update_s", "plan_s": "time/plan_s", "fetch_s": "time/fetch_s",
         "score_overlap_s": "time/score_overlap_s"}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", default="smollm2-concise,numeric,qwen2.5-0.5b", help=f"any of {', '.join(JOBS)}")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=0, help="override each job's max_steps (0: the job's)")
    p.add_argument("--lr", type=float, default=0.0, help="override each job's learning rate (0: the job's)")
    p.add_argument("--micro-batch", type=int, default=0, help="override each job's micro_batch_size")
    p.add_argument("--numeric-steps", type=int, default=30, help="max_steps of the numeric job")
    p.add_argument("--eager", action="store_true", help="CUDA graphs off (enforce_eager), as before issue 34")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rlfleet-gpu-grpo"))
    p.add_argument("--timeout", type=float, default=420.0, help="seconds one job may take")
    p.add_argument("--deadline", type=float, default=0.0, help="seconds all jobs may take together (0: none)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--rescore", type=Path, help="score a result file's held-out answers here (relevance, "
                   "answer checks) and add the target verdicts; no job runs")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = smoke.parse(p, argv, {"jobs": "tiny", "device": "cpu", "steps": 1, "timeout": 180.0})
    unknown = set(args.jobs.split(",")) - set(JOBS)
    if unknown:
        p.error(f"unknown job(s) {', '.join(sorted(unknown))}; expected any of {', '.join(JOBS)}")
    return args


def console_scripts(bin_dir: Path) -> None:
    """Put rlfleet's console scripts on PATH when the packages are importable but not installed
    (the GPU machine runs from ``PYTHONPATH``): the embedded launcher starts tiers by these names."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, module in SCRIPTS.items():
        if shutil.which(name):
            continue
        script = bin_dir / name
        script.write_text(
            f"#!{sys.executable}\nimport runpy\n\nif __name__ == '__main__':  # not in a spawned child\n"
            f"    runpy.run_module({module!r}, run_name='__main__')\n"
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


def main_job(name: str) -> dict[str, Any]:
    """A shipped job file with its data paths made absolute (the run's working directory is elsewhere)."""
    job = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    job["data"]["path"] = str(ROOT / job["data"]["path"])
    if job.get("eval", {}).get("data"):
        job["eval"]["data"] = str(ROOT / job["eval"]["data"])
    return job


def job_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The job file of ``name`` for ``args.device`` (colocated vLLM on CUDA, CUDA graphs on, the
    engine's memory share sized from the job: the rollout defaults)."""
    from rlfleet.common.schema.config import merge

    out = args.workdir / name
    vllm = {"rollout": {"engine": {"type": "vllm"}}}
    if name == "tiny":
        job = merge(main_job("tiny_grpo"), vllm)
    elif name == "smollm2-concise":  # the main job as shipped; held-out evaluation after every step
        job = merge(main_job("smollm2_concise"), {**vllm, "eval": {"every": 1}})
    elif name == "numeric":  # GSM8K-style problems on SmolLM2, held-out accuracy (pass@1) every 5 steps
        job = merge(main_job("gsm8k_numeric"), {
            **vllm, "model": "smollm2", "num_epochs": 4, "max_steps": args.numeric_steps,
            "batch": {"rollout_batch_size": 32, "train_batch_size": 16, "group_size": 8},
            "update": {"micro_batch_size": 64, "learning_rate": 1e-5},
            "max_prompt_length": 128, "max_response_length": 192,
            "eval": {"data": str(ROOT / NUMERIC_HELDOUT), "every": 5, "max_tokens": 192},
        })  # fmt: skip
    elif name == "qwen2.5-0.5b":
        sys.path.insert(0, str(Path(__file__).parent))
        from colocated_sync import write_model

        model = out / "model"
        if not (model / "config.json").exists():
            write_model("qwen2.5-0.5b", model, seed=0)
        job = {
            "description": "GRPO on a Qwen2.5-0.5B-shaped model (random init), digits reward",
            "model": {"name": str(model), "mixed_precision": "bf16"}, "reward": "charset:allowed=0123456789",
            "data": {"path": str(write_prompts(out / "prompts.jsonl", 512))},
            "max_prompt_length": 64,
            "num_epochs": 1, "max_steps": 8, "max_response_length": 256, "log_every": 1,
            "batch": {"rollout_batch_size": 32, "train_batch_size": 32, "group_size": 8},
            "update": {"micro_batch_size": 16, "learning_rate": 1e-6, "kl_coef": 0.0, "temperature": 1.0},
            "placement": {"seed": 0}, "weight_bucket_mb": 256,
            # the whole step's 256 samples in one engine batch, each up to 64 + 256 tokens
            "rollout": {"engine": {"type": "vllm", "max_model_len": 512}, "max_batch_size": 256},
        }  # fmt: skip
    else:
        raise SystemExit(f"unknown job {name!r}")
    job = merge(job, {"output_dir": str(out / "run"), "placement": {"device": args.device},
                      "loggers": ["jsonl"], "sample_table_size": 0})  # fmt: skip
    job["rollout"]["dtype"] = "bfloat16" if args.device == "cuda" else "float32"
    job["rollout"]["engine"]["colocate"] = args.device == "cuda"
    if args.eager:
        job["rollout"]["engine"]["enforce_eager"] = True
    if args.steps:
        job["max_steps"] = args.steps
    if args.lr:
        job["update"]["learning_rate"] = args.lr
    if args.micro_batch:
        job["update"]["micro_batch_size"] = args.micro_batch
    if getattr(args, "max_staleness", 0):  # async_pipeline.py's pipelined sides
        job["max_staleness"] = args.max_staleness
    if getattr(args, "seed", None) is not None:  # async_pipeline.py --seed
        job["placement"]["seed"] = args.seed
    if getattr(args, "sleep_level", None) is not None:  # async_pipeline.py --sleep-level
        job["rollout"]["engine"]["sleep_level"] = args.sleep_level
    if getattr(args, "partial_rollout_tokens", 0):  # async_pipeline.py --partial-tokens
        job["rollout"]["partial_rollout_tokens"] = args.partial_rollout_tokens
    return job


def run_rlfleet(job_path: Path, timeout: float) -> tuple[int | None, str, float]:
    """``rlfleet train job_path`` in its own process group (a timeout stops the whole fleet it started,
    which would otherwise hold the GPU for the next job): exit code (None: timed out), log tail, wall s."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(["rlfleet", "train", str(job_path)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = None
        log.seek(0)
        return code, log.read()[-4000:], time.perf_counter() - t0


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def run_job(name: str, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    job = job_config(name, args)
    run_dir = Path(job["output_dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    job_path = args.workdir / f"{name}.yaml"
    job_path.write_text(yaml.safe_dump(job, sort_keys=False))
    started = time.time()
    with GpuMemory() as memory:
        code, log, wall = run_rlfleet(job_path, timeout)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    result: dict[str, Any] = {"job": job, "exit_code": code, "wall_s": round(wall, 1), "steps": len(rows),
                              "peak_gpu_mib": memory.peak_mib or None, "started": started}  # fmt: skip
    if code is None:
        result["error"] = f"timed out after {timeout:.0f} s"
    evals = read_jsonl(run_dir / "eval.jsonl")
    if evals:  # the answers travel back; --rescore measures them where the scoring models are
        result["evals"] = evals
    if code != 0 or not rows:
        result["log_tail"] = log
    if not rows:
        return result
    timed = rows[1:] or rows
    for key, metric in SPLIT.items():
        values = [r[metric] for r in timed if metric in r]
        if values:
            result[key] = round(statistics.median(values), 4)
    if "step_s" in result:
        result["shares"] = {k: round(result[k] / result["step_s"], 3) for k in PHASES if k in result}
    result["memory"] = {k: max(r[k] for r in rows if k in r) for k in sorted({k for r in rows for k in r})
                        if k.startswith("memory/")}  # fmt: skip
    result["ipc_workers"] = rows[-1].get("publish/ipc_workers")
    result["reward_first"] = rows[0].get("reward/mean")
    result["reward_last"] = rows[-1].get("reward/mean")
    result["step_end_s"] = [round(r["time"] - started, 1) for r in rows if "time" in r]
    result["per_step"] = [{k: round(r[m], 4) for k, m in SPLIT.items() if m in r} for r in rows]
    result["rows"] = rows  # every metric of every step (the trainer's time/update_s, memory/*, ...)
    return result


def rescore_report(path: Path) -> None:
    """Measure a result file's held-out answers here (:mod:`heldout_targets`) and add the verdicts:
    the main job's time to its target, the numeric job's accuracy before and after."""
    sys.path.insert(0, str(Path(__file__).parent))
    from heldout_targets import concise_target, first_step_meeting, rescore

    from rlfleet.common.schema.config import load_config
    from rlfleet.controller.config import JobConfig

    report = json.loads(path.read_text())
    for name, result in report["jobs"].items():
        if not result.get("evals"):
            continue
        held = load_config(JobConfig, data=result["job"]).eval  # a result of the previous release: flat
        assert held.data is not None, "a job with held-out answers has eval.data"
        data = ROOT / "examples" / "data" / Path(held.data).name  # the file as it is in this checkout
        evals = rescore(result["evals"], data, held.limit_words)
        result["heldout"] = evals
        first, last = evals[0]["summary"], evals[-1]["summary"]
        result["heldout_before"], result["heldout_after"] = first, last
        if name == "smollm2-concise":
            result["target_after"] = concise_target(last, first)
            step = first_step_meeting(evals)
            result["target_step"] = step
            ends = result.get("step_end_s", [])
            result["time_to_target_s"] = ends[step - 1] if step and len(ends) >= step else None
        print(
            name, json.dumps({k: result.get(k) for k in ("target_after", "target_step", "time_to_target_s")})
        )
        print("  before:", {k: first.get(k) for k in ("mean_words", "within_limit", "relevance", "pass@1")})
        print("  after: ", {k: last.get(k) for k in ("mean_words", "within_limit", "relevance", "pass@1")})
    path.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rescore:
        rescore_report(args.rescore)
        return 0
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
    failed, begun = False, time.perf_counter()
    for name in args.jobs.split(","):
        left = args.deadline - (time.perf_counter() - begun) if args.deadline else args.timeout
        if left < 30:
            report["jobs"][name] = {"error": f"not run: {args.deadline:.0f} s deadline reached"}
            continue
        report["jobs"][name] = run_job(name, args, min(args.timeout, left))
        result = report["jobs"][name]
        failed = failed or result.get("exit_code") != 0
        shown = {k: v for k, v in result.items() if k not in ("job", "per_step", "evals", "rows")}
        print(name, json.dumps(shown), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(report, indent=2) + "\n"
        )  # after every job: a later one may not finish
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
