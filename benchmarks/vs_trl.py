"""Side by side with TRL: rlfleet's GRPO and TRL's GRPOTrainer on the same job, on one machine.

    uv run --extra cpu --group bench python benchmarks/vs_trl.py               # 10 steps each side
    uv run --extra cpu --group bench python benchmarks/vs_trl.py --steps 1 --only trl   # one side, 1 step
    uv run --extra cpu --group bench python benchmarks/vs_trl.py --smoke   # both built, none trained (CI)

``--smoke`` trains nothing (one step of SmolLM2 takes minutes on CPU): it runs ``prepare`` (the job with
the benchmark's overrides, validated, and the prompts in rlfleet's order), validates the CUDA mode's
overrides too, and runs TRL's side as its subprocess under the memory sampler, which builds TRL's
GRPOTrainer from the GRPOConfig and calls the rlfleet reward once, then stops before training.

Both sides train SmolLM2-135M-Instruct (the local folder rlfleet's ``smollm2`` alias resolves to)
with the main job's settings (examples/smollm2_concise.yaml: reward spec, learning rate, KL
coefficient, temperature, clip range, weight decay, gradient clipping, micro-batch, and the
precision rlfleet's trainer resolves from ``model.mixed_precision``; where that is bf16, rlfleet's
vLLM engine generates in bf16 too, as TRL generates under its bf16 autocast), changed only where the
comparison says so: every parameter trains (``model.trainable_layers`` unset), 8 prompts x 4 samples
a step with one optimizer step (TRL's ``num_iterations=1`` over one generation batch), at most 96
response tokens, no held-out evaluation, no sample table. The prompts are the first ``8 * steps`` of
examples/data/questions.jsonl; TRL gets them in the order rlfleet's seeded shuffle visits them
(``PromptDataset.batches``), unshuffled, so step k sees the same 8 prompts on both sides. TRL's
reward function calls the job's rlfleet reward in-process on what rlfleet's reward tier is handed
(the chat-rendered prompt decoded without special tokens, the answer text), so both optimize the
same function. TRL: no vLLM (CPU), AdamW with rlfleet's betas and epsilon, constant learning rate,
``loss_type='dapo'`` (token mean over the batch, as rlfleet's ``update.loss_agg=token-mean``),
``scale_rewards='group'`` (GRPO's group std), activation checkpointing off.

TRL runs twice, as two sides: ``trl`` computes the 32 samples in micro-batches of the job's
``update.micro_batch_size`` with gradient accumulation, as rlfleet's trainer does (the like-for-like
comparison); ``trl_one_micro_batch`` computes them in one forward and backward, the configuration
issue 14's reference numbers (about 47 s/step, 14.6 GiB) were measured with. Ratios are reported
against each.

Each side runs as its own subprocess, one after the other: rlfleet as the real CLI (``rlfleet
train``, which starts nats-server and its worker processes), TRL as this script with
``--trl-child``. Measured: s/step = (end of the last step - end of the first) / (steps - 1), so
start-up and the first step (warm-up) are left out (with ``--steps 1`` only the first step's time
is there); peak memory = the largest sum of RSS over the side's whole process tree, sampled every
``--sample-s`` (a page shared by several processes counts in each), and of PSS (shared pages split
between the processes that map them), sampled every ``--pss-every`` s as it is costly; reward and
response length (tokens) of the last step; the load average and the machine. Results:
``benchmarks/results/vs_trl.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import smoke  # noqa: E402  (this folder's helper modules)
from gpu_memory import GpuMemory  # noqa: E402
from tree_memory import GIB, TreeMemory  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "vs_trl.json"
BIN = Path(sys.executable).parent
MAIN_JOB = REPO / "examples" / "smollm2_concise.yaml"
PROMPTS = REPO / "examples" / "data" / "questions.jsonl"
PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, RESPONSE_TOKENS = 8, 4, 96
COMPILED = "_compiled"
SIDES = ("rlfleet", "trl", "trl_one_micro_batch", "rlfleet_pipelined", "rlfleet_layerwise",
         *(n + COMPILED for n in ("rlfleet", "rlfleet_pipelined", "trl_one_micro_batch")))  # fmt: skip
DEFAULT_SIDES = SIDES[:3]
TRL_SIDES = ("trl", "trl_one_micro_batch")
DEVICES = ("cpu", "cuda")
HELDOUT = REPO / "examples" / "data" / "questions_heldout.jsonl"
"""``trl``: TRL in micro-batches of the job's ``micro_batch_size`` (as rlfleet's trainer computes);
``trl_one_micro_batch``: TRL with the whole 32-sample batch in one micro-batch (no accumulation),
the configuration issue 14's reference numbers were measured with; ``rlfleet_pipelined`` (not run
unless named): rlfleet with ``max_staleness: 1``, generating the next batch while the trainer trains
(a batch is trained one version after the weights that sampled it; TRL's GRPOTrainer has no such
mode, so it is reported beside the like-for-like ratios, never in their place); ``rlfleet_layerwise``
(not run unless named): ``rlfleet`` with vLLM's layerwise weight reload on the GPU instead of the
in-place load (``RLFLEET_VLLM_LAYERWISE_RELOAD=1``), to compare the two loads on one card. A side
named with ``_compiled`` (not run unless named) is that side with its trainer's model compiled:
rlfleet's ``model.compile: true`` (its decoder blocks), TRL's ``torch_compile=True`` (the model)."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="training steps of each side")
    p.add_argument(
        "--device", default="cpu", choices=DEVICES, help="cuda: both sides colocate vLLM on one GPU"
    )
    p.add_argument("--only", choices=SIDES, help="run one side only")
    p.add_argument(
        "--sides",
        default=",".join(DEFAULT_SIDES),
        help=f"the sides to run, in order (comma-separated; any of {', '.join(SIDES)})",
    )
    p.add_argument("--micro-batch", type=int, default=0, help="both sides' micro-batch (0: the job's)")
    p.add_argument("--awake", action="store_true", help="CUDA: both colocated engines stay awake while "
                   "the trainer steps (rlfleet sleep_level 0, TRL vllm_enable_sleep_mode off)")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS, help="result JSON")
    p.add_argument("--job", type=Path, default=MAIN_JOB, help="the rlfleet job whose settings both use")
    p.add_argument("--sample-s", type=float, default=0.5, help="seconds between RSS samples")
    p.add_argument("--pss-every", type=float, default=10.0, help="seconds between PSS samples (0: none)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one side may take")
    p.add_argument("--rescore", type=Path, help="measure a GPU result file's held-out answers here "
                   "(relevance) and add the target verdicts; nothing trains")  # fmt: skip
    p.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)  # internal: run TRL's side
    p.add_argument("--eval-child", type=Path, help=argparse.SUPPRESS)  # internal: held-out answers
    p.add_argument("--one-micro-batch", action="store_true", help=argparse.SUPPRESS)  # internal, with it
    p.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)  # internal, with it
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = smoke.parse(p, None, {"steps": 1})
    if args.out == RESULTS and args.device == "cuda":
        args.out = RESULTS.with_name("vs_trl_gpu.json")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def bench_overrides(
    steps: int, data: Path, out: Path, device: str = "cpu", micro_batch: int = 0, awake: bool = False
) -> list[str]:
    """``key=value`` overrides that turn the main job into the benchmark's rlfleet side (on CUDA: vLLM
    colocated with the trainer on the one GPU, bf16, CUDA graphs and the memory share at their defaults;
    with ``awake`` the engine does not sleep while the trainer steps)."""
    overrides = [
        f"max_steps={steps}", "num_epochs=1", f"data.path={data}", f"output_dir={out}",
        f"batch.rollout_batch_size={PROMPTS_PER_STEP}", f"batch.train_batch_size={PROMPTS_PER_STEP}",
        f"batch.group_size={SAMPLES_PER_PROMPT}", f"max_response_length={RESPONSE_TOKENS}",
        "model.trainable_layers=null", "loggers=[jsonl]", "sample_table_size=0", "save_every=0",
        "eval.data=null",  # no held-out evaluation in the timed run
    ]  # fmt: skip
    if device == "cuda":
        overrides += ["placement.device=cuda", "rollout.engine.type=vllm", "rollout.engine.colocate=true",
                      "rollout.dtype=bfloat16"]  # fmt: skip
        overrides += ["rollout.engine.sleep_level=0"] if awake else []
    if micro_batch:
        overrides.append(f"update.micro_batch_size={micro_batch}")
    return overrides


def prepare(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The shared setup (written to ``workdir/setup.json`` for the TRL child): settings, prompts, order."""
    from rlfleet.common.schema.config import load_config
    from rlfleet.common.schema.trainer import resolve_precision
    from rlfleet.controller.config import JobConfig
    from rlfleet.controller.dataset import PromptDataset
    from rlfleet.controller.models import resolve_model

    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[: PROMPTS_PER_STEP * args.steps]
    if len(lines) < PROMPTS_PER_STEP * args.steps:
        raise SystemExit(f"{PROMPTS} has {len(lines)} prompts, fewer than {PROMPTS_PER_STEP} x {args.steps}")
    data = workdir / "prompts.jsonl"
    data.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    overrides = bench_overrides(
        args.steps, data, workdir / "rlfleet", args.device, args.micro_batch, args.awake
    )
    job = load_config(JobConfig, args.job, overrides)
    if resolve_precision(job.model.mixed_precision, args.device) == "bf16" and job.rollout.dtype == "float32":
        # TRL generates under the bf16 autocast it trains with: the engine generates in bf16 too
        overrides.append("rollout.dtype=bfloat16")
        job = load_config(JobConfig, args.job, overrides)
    seed = job.placement.seed
    model_dir = resolve_model(job.model.name, seed=seed)
    dataset = PromptDataset(data, max_prompt_length=job.max_prompt_length, seed=seed,
                            system_prompt=job.data.system_prompt, overlong=job.data.overlong,
                            tokenizer=model_dir)  # fmt: skip
    order = [item.index for batch in dataset.batches(PROMPTS_PER_STEP) for item in batch]
    if len(order) < PROMPTS_PER_STEP * args.steps:
        raise SystemExit(f"only {len(order)} prompts fit max_prompt_length={job.max_prompt_length}")
    setup = {
        "steps": args.steps, "model_dir": str(model_dir), "job_file": str(args.job), "overrides": overrides,
        "rows": [json.loads(lines[i]) for i in order], "order": order,
        "settings": job.trainer_config().model_dump(mode="json"), "reward": job.reward.spec,
        "prompt_key": job.data.prompt_key, "system_prompt": job.data.system_prompt, "seed": seed,
        "device": args.device, "max_model_len": job.rollout.context_cap,
        "max_batch_size": job.rollout.max_batch_size, "eval_max_tokens": job.eval.max_tokens,
        "eval_limit_words": job.eval.limit_words, "awake": args.awake,
    }  # fmt: skip
    if args.device == "cuda":
        setup["engine_share"] = engine_share(setup)
    (workdir / "setup.json").write_text(json.dumps(setup, indent=2) + "\n")
    return setup


def run_side(
    name: str, command: list[str], workdir: Path, args: argparse.Namespace, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one side's command (with ``env`` added) to the end under :class:`TreeMemory`; its wall
    time and memory."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env or {})}  # fmt: skip
    log = workdir / f"{name}.log"
    load_before = [round(x, 2) for x in os.getloadavg()]
    start = time.time()
    with log.open("w") as sink, GpuMemory() as gpu:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        with TreeMemory(proc.pid, args.sample_s, args.pss_every) as memory:
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the side's whole tree: the next side needs the GPU
                rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"{name} failed (rc {rc}); the end of {log}:\n{log.read_text()[-3000:]}")
    gpu_peak = {"peak_gpu_gib": round(gpu.peak_mib / 1024, 2)} if gpu.peak_mib else {}
    return {"wall_s": round(time.time() - start, 1), "load_avg_before": load_before,
            "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            **memory.report(), **gpu_peak}  # fmt: skip


def step_figures(ends: list[float], first_step_s: float, rewards: list[float], lengths: list[float]) -> dict:
    """s/step from the steps' end times (first step excluded; each step's own in ``step_s``, to compare
    the later steps, whose answers are shorter), and the last step's reward and length."""
    n = len(ends)
    return {
        "steps": n, "s_per_step": round((ends[-1] - ends[0]) / (n - 1), 2) if n > 1 else None,
        "step_s": [round(b - a, 3) for a, b in zip(ends[:-1], ends[1:], strict=True)],
        "first_step_s": round(first_step_s, 2), "reward_last": round(rewards[-1], 4),
        "reward_mean": round(statistics.fmean(rewards), 4), "length_tokens_last": round(lengths[-1], 1),
        "rewards": [round(r, 4) for r in rewards], "lengths_tokens": [round(x, 1) for x in lengths],
    }  # fmt: skip


PHASES = ("generate_s", "score_s", "train_s", "fetch_s", "update_s", "plan_s", "publish_s")
"""rlfleet's ``time/*`` metrics of a step, averaged over steps 2..N in the result (train = the
trainer's fetch + update + its reply; update = plan + the update loop); beside them the rollout
worker's weight load (``rollout/load_s_max``) and the trainer-engine logprob gap
(``off_policy/mismatch_kl``)."""
WATCHED = ("rollout/load_s_max", "off_policy/mismatch_kl", "rollout_logprob_diff")


def rlfleet_command(workdir: Path) -> str:
    """The ``rlfleet`` console script: the venv's, or (on a machine that runs rlfleet from
    ``PYTHONPATH``, as the GPU machine does) scripts written for the tiers the embedded launcher starts."""
    if (BIN / "rlfleet").exists():
        return str(BIN / "rlfleet")
    from gpu_grpo import console_scripts

    console_scripts(workdir / "bin")  # puts them on PATH, where the run's children find them too
    return shutil.which("rlfleet") or "rlfleet"


def run_rlfleet(
    setup: dict[str, Any], workdir: Path, args: argparse.Namespace, pipelined: bool = False,
    layerwise: bool = False, compiled: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """rlfleet's side: the job as the CLI runs it; ``pipelined``: with ``max_staleness: 1`` (its own
    output folder, ``rlfleet_pipelined``); ``layerwise``: vLLM's layerwise reload (``rlfleet_layerwise``);
    ``compiled``: ``model.compile: true`` (the name gains ``_compiled``)."""
    name = "rlfleet_pipelined" if pipelined else "rlfleet_layerwise" if layerwise else "rlfleet"
    name += COMPILED if compiled else ""
    extra = [f"output_dir={workdir / name}"] if name != "rlfleet" else []
    extra += ["max_staleness=1"] if pipelined else []
    extra += ["model.compile=true"] if compiled else []
    command = [rlfleet_command(workdir), "train", setup["job_file"], *setup["overrides"], *extra]
    env = {"RLFLEET_VLLM_LAYERWISE_RELOAD": "1"} if layerwise else {"RLFLEET_VLLM_LAYERWISE_RELOAD": "0"}
    measured = run_side(name, command, workdir, args, env)
    rows = [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    rewards, lengths = [r["reward/mean"] for r in rows], [r["response_length"] for r in rows]
    figures = step_figures([r["time"] for r in rows], rows[0]["time/step_s"], rewards, lengths)
    timed = rows[1:] or rows  # the first step (warm-up) left out, as in s/step
    phases = {name: round(statistics.fmean(r[f"time/{name}"] for r in timed), 3)
              for name in PHASES if f"time/{name}" in timed[0]}  # fmt: skip
    watched = {key: round(statistics.fmean(r[key] for r in timed), 5) for key in WATCHED if key in timed[0]}
    return {**figures, "phases_mean": phases, "watched_mean": watched, **measured,
            "command": " ".join(command), "rows": rows}  # fmt: skip


def trl_side(one_micro_batch: bool, compiled: bool = False) -> str:
    return ("trl_one_micro_batch" if one_micro_batch else "trl") + (COMPILED if compiled else "")


def trl_model_dir(workdir: Path, one_micro_batch: bool, compiled: bool = False) -> Path:
    return workdir / f"{trl_side(one_micro_batch, compiled)}_model"


def trl_steps_file(workdir: Path, one_micro_batch: bool, compiled: bool = False) -> Path:
    """Where a TRL child writes its steps (the TRL sides share the work folder)."""
    return workdir / f"{trl_side(one_micro_batch, compiled)}_steps.json"


def run_trl(
    setup: dict[str, Any], workdir: Path, args: argparse.Namespace, one: bool = False, compiled: bool = False
) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--trl-child", str(workdir)]
    command += (["--one-micro-batch"] if one else []) + (["--compiled"] if compiled else [])
    measured = run_side(trl_side(one, compiled), command, workdir, args)
    steps = json.loads(trl_steps_file(workdir, one, compiled).read_text())
    ends = [s["time"] for s in steps["steps"]]
    figures = step_figures(ends, ends[0] - steps["train_begin"], [s["reward"] for s in steps["steps"]],
                           [s["length"] for s in steps["steps"]])  # fmt: skip
    return {**figures, **measured, "grpo_config": steps["grpo_config"]}


def trl_reward_fn(setup: dict[str, Any], tokenizer: Any) -> Any:
    """The job's rlfleet reward as a TRL reward function, on the texts rlfleet's reward tier sees."""
    from rlfleet.reward.registry import build_reward

    reward, rendered = build_reward(setup["reward"]), {}
    meta_keys = [k for k in setup["rows"][0] if k != setup["prompt_key"]]

    def as_reward_tier_sees(messages: list[dict[str, str]]) -> str:
        key = json.dumps(messages)
        if key not in rendered:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            rendered[key] = tokenizer.decode(ids, skip_special_tokens=True)
        return rendered[key]

    def rlfleet_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        metadata = [{k: kwargs[k][i] for k in meta_keys} for i in range(len(texts))]
        return list(reward.score([as_reward_tier_sees(p) for p in prompts], texts, metadata).total)

    return rlfleet_reward


def trl_config(
    setup: dict[str, Any], workdir: Path, one_micro_batch: bool = False, compiled: bool = False
) -> Any:
    """TRL's GRPOConfig matching the rlfleet side's settings; with ``one_micro_batch`` the whole
    batch is one forward and backward (no gradient accumulation), else micro-batches as rlfleet's;
    ``compiled``: ``torch_compile=True``."""
    from trl import GRPOConfig

    from rlfleet.common.schema.trainer import resolve_precision
    from rlfleet.trainer.loop import BETAS, EPS

    settings, samples, device = setup["settings"], PROMPTS_PER_STEP * SAMPLES_PER_PROMPT, setup["device"]
    s = settings["update"]  # the run's update section
    bf16 = resolve_precision(settings["model"]["mixed_precision"], device) == "bf16"  # as rlfleet's trainer
    micro = samples if one_micro_batch else min(s["micro_batch_size"], samples)
    return GRPOConfig(**trl_generation(setup),
        output_dir=str(workdir / "trl"), max_steps=setup["steps"], per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples // micro, num_generations=SAMPLES_PER_PROMPT,
        max_completion_length=RESPONSE_TOKENS, temperature=s["temperature"], top_p=1.0, top_k=0,
        beta=s["kl_coef"], epsilon=s["clip_eps"], num_iterations=s["ppo_epochs"], loss_type="dapo",
        scale_rewards="group", learning_rate=s["learning_rate"], lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
        weight_decay=s["weight_decay"], max_grad_norm=s["max_grad_norm"], bf16=bf16,
        gradient_checkpointing=False, use_cpu=device == "cpu", logging_steps=1, report_to="none",
        save_strategy="no", shuffle_dataset=False, seed=setup["seed"],
        dataloader_num_workers=0, model_init_kwargs={"dtype": "float32"}, disable_dropout=True,
        log_completions=False, torch_compile=compiled,
    )  # fmt: skip


def trl_generation(setup: dict[str, Any]) -> dict[str, Any]:
    """TRL's generation settings: none on CPU (TRL generates with the training model); on CUDA its
        colocated vLLM engine, given what rlfleet's engine gets: the memory share rlfleet sizes for this
        model and batch (``gpu_memory_utilization: auto``), the same context cap and sequences at once,
        and sleep mode on as rlfleet's colocated engine sleeps while the trainer steps (off with ``--awake``,
    where rlfleet's stays awake too)."""
    if setup["device"] != "cuda":
        return {"use_vllm": False}
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": setup["engine_share"],
            "vllm_max_model_length": setup["max_model_len"],
            "vllm_enable_sleep_mode": not setup.get("awake", False)}  # fmt: skip


def engine_share(setup: dict[str, Any]) -> float:
    """The GPU memory share rlfleet's colocated vLLM engine takes for this model and batch (auto)."""
    from rlfleet.rollout.engines.checkpoint import read_checkpoint
    from rlfleet.rollout.engines.vllm.memory_budget import engine_memory_fraction

    info = read_checkpoint(setup["model_dir"])
    return engine_memory_fraction(info.config, info.weights, dtype="bfloat16",
                                  max_num_seqs=setup["max_batch_size"],
                                  max_model_len=setup["max_model_len"]).share  # fmt: skip


def trl_child(workdir: Path, one_micro_batch: bool, build_only: bool = False, compiled: bool = False) -> int:
    """TRL's side (a subprocess of the driver): train, writing each step's end time, reward, length.
    ``build_only`` (``--smoke``): build the trainer and call the reward once, train nothing."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    setup = json.loads((workdir / "setup.json").read_text())
    system = [{"role": "system", "content": setup["system_prompt"]}] if setup["system_prompt"] else []
    key = setup["prompt_key"]
    rows = [{**r, key: [*system, {"role": "user", "content": r[key]}]} for r in setup["rows"]]
    tokenizer = AutoTokenizer.from_pretrained(setup["model_dir"])
    record: dict[str, Any] = {"steps": []}

    class StepClock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            record["train_begin"] = time.time()

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:  # logging_steps=1: one log per step, at its end
                length = logs.get("completions/mean_length", float("nan"))
                record["steps"].append({"step": state.global_step, "time": time.time(),
                                        "reward": logs["reward"], "length": length})  # fmt: skip

    config = trl_config(setup, workdir, one_micro_batch, compiled)
    reward_fn = trl_reward_fn(setup, tokenizer)
    trainer = GRPOTrainer(model=setup["model_dir"], reward_funcs=reward_fn, args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          callbacks=[StepClock()])  # fmt: skip
    if build_only:
        first = rows[0]
        scores = reward_fn([first[key]], ["Short."], **{k: [v] for k, v in first.items() if k != key})
        print(f"smoke: GRPOTrainer built; the reward of one answer: {scores}")
        return 0
    trainer.train()
    if setup["device"] == "cuda":  # the trained model, for the held-out answers
        trainer.save_model(str(trl_model_dir(workdir, one_micro_batch, compiled)))
    record["grpo_config"] = {
        k: v for k, v in config.to_dict().items() if isinstance(v, int | float | str | bool)
    }
    trl_steps_file(workdir, one_micro_batch, compiled).write_text(
        json.dumps(record, indent=2, default=str) + "\n"
    )
    return 0


def eval_child(workdir: Path) -> int:
    """Held-out answers of the base model and of each side's trained model, all by one evaluator:
    transformers on the GPU, bf16, greedy, the job's chat template and ``eval_max_tokens``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfleet.controller.eval_metrics import make_row

    setup = json.loads((workdir / "setup.json").read_text())
    models = {"base": Path(setup["model_dir"]), "rlfleet": workdir / "rlfleet" / "final"}
    models |= {side: workdir / side / "final" for side in SIDES if side.startswith("rlfleet_")}
    models |= {
        trl_side(one, c): trl_model_dir(workdir, one, c) for one in (False, True) for c in (False, True)
    }
    rows = [json.loads(line) for line in HELDOUT.read_text(encoding="utf-8").splitlines() if line.strip()]
    system = [{"role": "system", "content": setup["system_prompt"]}] if setup["system_prompt"] else []
    tokenizer = AutoTokenizer.from_pretrained(setup["model_dir"], padding_side="left")
    if tokenizer.pad_token is None:  # SmolLM2's tokenizer has none; rlfleet's engines pad with EOS too
        tokenizer.pad_token = tokenizer.eos_token
    questions = [r[setup["prompt_key"]] for r in rows]
    texts = [tokenizer.apply_chat_template([*system, {"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]  # fmt: skip
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
    out: dict[str, Any] = {}
    for side, path in models.items():
        if not (path / "config.json").exists():
            continue
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
        with torch.no_grad():
            ids = model.generate(**batch, max_new_tokens=setup["eval_max_tokens"], do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        ids = ids[:, batch["input_ids"].shape[1] :]
        answers = []
        for i, seq in enumerate(ids.tolist()):
            seq = [t for t in seq if t != tokenizer.pad_token_id]
            text = tokenizer.decode(seq, skip_special_tokens=True).strip()
            answers.append(make_row(i, questions[i], 0, text, len(seq), setup["eval_limit_words"]).to_json())
        out[side] = {"label": side, "step": 0 if side == "base" else setup["steps"], "rows": answers}
        del model
        torch.cuda.empty_cache()
    (workdir / "heldout.json").write_text(json.dumps(out) + "\n")
    return 0


def rescore_report(path: Path) -> None:
    """Measure a GPU result's held-out answers here (:mod:`heldout_targets`): each side's summary after
    its steps against the base model's, and whether the main job's target holds."""
    from heldout_targets import concise_target, rescore

    report = json.loads(path.read_text())
    answers = report.get("heldout_answers") or {}
    if "base" not in answers:
        raise SystemExit(f"{path} holds no held-out answers of the base model")
    summaries = {r["label"]: r["summary"] for r in rescore(list(answers.values()), HELDOUT, 50)}
    base = summaries["base"]
    report["heldout"] = {"base": base}
    for side, summary in summaries.items():
        if side != "base":
            report["heldout"][side] = {"summary": summary, "target": concise_target(summary, base)}
        print(side, {k: summary.get(k) for k in ("mean_words", "within_limit", "similarity")})
    path.write_text(json.dumps(report, indent=2) + "\n")


def machine() -> dict[str, Any]:
    import psutil
    import torch
    import transformers
    import trl

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    memory = round(psutil.virtual_memory().total / GIB, 1)
    from rlfleet.common.schema.trainer import CPU_BF16_ENV, cpu_has_native_bf16

    gpu = {}
    if torch.cuda.is_available():
        import vllm

        gpu = {"gpu": torch.cuda.get_device_name(0), "vllm": vllm.__version__,
               "gpu_memory_gib": round(torch.cuda.mem_get_info()[1] / GIB, 1)}  # fmt: skip
    return {**gpu, "cpu_count": os.cpu_count(), "cpu": cpu, "memory_gib": memory,
            "python": sys.version.split()[0],
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "git_commit": commit.strip(), "cpu_native_bf16": cpu_has_native_bf16(),
            CPU_BF16_ENV: os.environ.get(CPU_BF16_ENV)}  # fmt: skip


def ratios(sides: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each rlfleet side against each TRL side that finished, keyed ``"<rlfleet side> vs <TRL side>"``:
    ``speed`` is TRL's s/step over rlfleet's (above 1: rlfleet is faster), ``gpu_memory`` and ``rss``
    TRL's peak over rlfleet's (above 1: rlfleet holds less). Every pair is kept, so a reader sees the
    like-for-like one (synchronous against TRL) beside the pipelined one, never one in the other's place."""
    out: dict[str, dict[str, float]] = {}
    finished = {name: side for name, side in sides.items() if side.get("s_per_step")}
    for trl_name, trl in ((n, s) for n, s in finished.items() if n.startswith("trl")):
        for name, ours in ((n, s) for n, s in finished.items() if n.startswith("rlfleet")):
            ratio = {"speed": round(trl["s_per_step"] / ours["s_per_step"], 2)}
            for key, field in (("gpu_memory", "peak_gpu_gib"), ("rss", "peak_rss_gib")):
                if trl.get(field) and ours.get(field):
                    ratio[key] = round(trl[field] / ours[field], 2)
            out[f"{name} vs {trl_name}"] = ratio
    return out


def print_table(report: dict[str, Any]) -> None:
    sides = report["sides"]
    rows = [("s/step (steps 2..N)", "s_per_step"), ("first step s", "first_step_s"), ("wall s", "wall_s"),
            ("peak GPU GiB (card)", "peak_gpu_gib"), ("peak RSS GiB (tree sum)", "peak_rss_gib"),
            ("peak PSS GiB (sampled)", "peak_pss_gib_sampled"),
            ("processes", "peak_processes"), ("reward, last step", "reward_last"),
            ("length tokens, last step", "length_tokens_last"),
            ("load avg 1m max", "load_avg_1m_max")]  # fmt: skip
    print("| | " + " | ".join(sides) + " |")
    print("| --- |" + " --- |" * len(sides))
    for label, key in rows:
        print(f"| {label} | " + " | ".join(str(side.get(key)) for side in sides.values()) + " |")
    for pair, ratio in report.get("ratios", {}).items():
        print(f"{pair}: TRL's s/step / rlfleet's {ratio['speed']}x, TRL's card peak / rlfleet's "
              f"{ratio.get('gpu_memory')}, TRL's RSS / rlfleet's {ratio.get('rss')}")  # fmt: skip
    m = report["machine"]
    print(f"machine: {m['cpu_count']} cores, {m['cpu']}, {m['memory_gib']} GiB, GPU {m.get('gpu')}")


def smoke_check(args: argparse.Namespace) -> int:
    """``--smoke`` (see the module docstring): both sides' setup and TRL's trainer built, nothing trained."""
    from rlfleet.common.schema.config import load_config
    from rlfleet.controller.config import JobConfig

    report: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "smoke": True, "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="vs-trl-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        setup = prepare(args, workdir)
        cuda = bench_overrides(args.steps, workdir / "prompts.jsonl", workdir / "rlfleet", "cuda", 32, True)
        job = load_config(JobConfig, args.job, [*cuda, "max_staleness=1"])  # the CUDA modes' overrides too
        modes = (job.rollout.engine.sleep_level, job.update.micro_batch_size, job.max_staleness)
        assert modes == (0, 32, 1), modes
        command = [sys.executable, str(Path(__file__).resolve()), "--trl-child", str(workdir), "--smoke"]
        report["trl_built"] = run_side("trl", command, workdir, args)
        report["setup"] = {k: setup[k] for k in ("model_dir", "overrides", "order", "reward", "settings")}
        rlfleet = [rlfleet_command(workdir), "train", setup["job_file"], *setup["overrides"]]
        report["rlfleet_command"] = " ".join(rlfleet)  # the side's command, as run_rlfleet runs it
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("smoke: prepared both sides and built TRL's GRPOTrainer; trained neither (a step of SmolLM2 "
          f"takes minutes on CPU); wrote {args.out}")  # fmt: skip
    return 0


def main() -> int:
    args = parse_args()
    if args.trl_child is not None:
        return trl_child(args.trl_child, args.one_micro_batch, build_only=args.smoke, compiled=args.compiled)
    if args.eval_child is not None:
        return eval_child(args.eval_child)
    if args.rescore is not None:
        rescore_report(args.rescore)
        return 0
    if args.smoke:
        return smoke_check(args)
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "steps": args.steps,
        "machine": machine(),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
    }
    with tempfile.TemporaryDirectory(prefix="vs-trl-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        setup = prepare(args, workdir)
        report["setup"] = {
            k: setup[k] for k in ("model_dir", "job_file", "overrides", "order", "reward", "settings")
        }
        report["setup"]["trl_generation"] = trl_generation(setup)
        runners = {"rlfleet": run_rlfleet, "trl": run_trl,
                   "trl_one_micro_batch": lambda *a, **k: run_trl(*a, one=True, **k),
                   "rlfleet_pipelined": lambda *a, **k: run_rlfleet(*a, pipelined=True, **k),
                   "rlfleet_layerwise": lambda *a, **k: run_rlfleet(*a, layerwise=True, **k)}  # fmt: skip
        runners |= {n + COMPILED: functools.partial(runners[n], compiled=True)
                    for n in SIDES if n + COMPILED in SIDES}  # fmt: skip
        report["sides"] = {}
        for name in (args.only,) if args.only else [n for n in args.sides.split(",") if n in runners]:
            print(f"running {name} for {args.steps} steps ...", flush=True)
            try:
                report["sides"][name] = runners[name](setup, workdir, args)
            except RuntimeError as exc:  # one side's failure is reported; the others still run
                report["sides"][name] = {"error": str(exc)[-3000:]}
                print(exc, flush=True)
        if args.device == "cuda":  # held-out answers of each trained model (scored with --rescore)
            command = [sys.executable, str(Path(__file__).resolve()), "--eval-child", str(workdir)]
            subprocess.run(command, cwd=REPO, check=False, timeout=args.timeout)
            if (workdir / "heldout.json").exists():
                report["heldout_answers"] = json.loads((workdir / "heldout.json").read_text())
    report["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["ratios"] = ratios(report["sides"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
