"""The ``rlfleet`` command line: ``rlfleet train CONFIG.yaml [a.b=c ...]``.

Heavy modules (torch, transformers) are imported only once a command runs, so ``--help`` is instant.

Exit codes: 0 done; 2 the user's mistake (any :class:`~rlfleet.common.errors.UserError`: a bad
config, model, dataset, checkpoint, reward spec or rollout fn, a worker's settings conflict), with
its one-line reason; 1 a runtime failure (a :class:`~rlfleet.common.errors.Failure`: a worker died
or never came up, a request failed), with its one-line reason, or a crash (any other exception),
with its traceback; 130 on Ctrl-C, 128 + N on signal N (SIGTERM: 143).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlfleet.common.errors import ConfigError
    from rlfleet.controller.config import JobConfig
    from rlfleet.controller.trainer_base import TrainerBase

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    from rlfleet.controller.config import JobConfig
    from rlfleet.controller.config_fields import main_keys_text

    parser = argparse.ArgumentParser(
        prog="rlfleet", description="RL post-training of LLMs over a fleet of services",
        epilog="start with: rlfleet train examples/tiny_grpo.yaml; every key: rlfleet config --fields",
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="run a training job from a YAML/TOML config",
        description="Run a training job: a job file (YAML or TOML, see examples/) with KEY=VALUE overrides "
        "on top (a.b.c=value; values read as YAML). A run's own outputs/<run>/config.yaml is a job file too.",
        epilog=main_keys_text(JobConfig) + "\n\nevery key, default and description: rlfleet config --fields",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    train.add_argument("config", type=Path, help="job config (see examples/)")
    train.add_argument("overrides", nargs="*", help="config overrides: a.b.c=value")
    train.add_argument("--log-level", default="WARNING", help="controller log level (default WARNING)")
    show = sub.add_parser(
        "config", help="print the resolved config of a job file (JSON), or every key (--fields)",
        description="Print a job file's resolved config as JSON (the file with its overrides, validated), "
        "or with --fields every key of a job file as YAML: its default, under its description.",
    )  # fmt: skip
    show.add_argument("config", type=Path, nargs="?", help="job config (not with --fields)")
    show.add_argument("overrides", nargs="*", help="config overrides: a.b.c=value")
    show.add_argument("--fields", action="store_true", help="every key, default and description, as YAML")
    sub.add_parser("env", help="print what a bug report needs: versions (rlfleet, torch, vLLM), CUDA, CPU")
    from rlfleet.controller.evaluation import add_eval_parser
    from rlfleet.controller.plots import add_plot_parser
    from rlfleet.controller.status import add_status_parser

    add_status_parser(sub)
    add_eval_parser(sub)
    add_plot_parser(sub)
    return parser


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("rlfleet-controller")
    except metadata.PackageNotFoundError:  # a source tree without the package installed
        return "unknown"


def _load_job(path: Path, overrides: Sequence[str]) -> JobConfig:
    from rlfleet.common.errors import ConfigError
    from rlfleet.common.schema.config import load_config
    from rlfleet.common.schema.trainer import cpu_bf16_override
    from rlfleet.controller.config import JobConfig

    try:
        job = load_config(JobConfig, path, list(overrides))
    except ConfigError as exc:
        raise _short(exc) from None
    if job.model.mixed_precision == "auto":  # a malformed RLFLEET_CPU_BF16 is the user's to fix, at once
        cpu_bf16_override()
    data_path = Path(job.data.path)
    if not data_path.is_absolute() and not data_path.exists() and (path.parent / data_path).exists():
        job.data.path = str(path.parent / data_path)
    held_out = Path(job.eval.data) if job.eval.data else None  # relative to the job file, as data.path
    if (
        held_out
        and not held_out.is_absolute()
        and not held_out.exists()
        and (path.parent / held_out).exists()
    ):
        job.eval.data = str(path.parent / held_out)
    here = str(path.parent.resolve())  # a reward / rollout_fn 'module:function' may live next to the job
    if here not in job.python_path:
        job.python_path = [*job.python_path, here]
    return job


def _short(exc: ConfigError) -> ConfigError:
    """``exc`` said in one short line: a did-you-mean without the list of every field after it, and
    a check of the whole config by the setting it names (``launcher.address: only used with
    launcher=ray``) instead of the whole config as its value."""
    from rlfleet.common.errors import ConfigError
    from rlfleet.controller.config_names import short_reason

    reason = short_reason(exc.reason)
    if exc.path == "<root>" and isinstance(exc.value, dict):
        reason = reason.removeprefix("Value error, ")
        where, sep, why = reason.partition(": ")
        if sep and where.replace(".", "").replace("_", "").replace(", ", "").isalnum():
            return ConfigError(where, _value_at(exc.value, where), why)
        return ConfigError("<root>", "(the job)", reason)
    return ConfigError(exc.path, exc.value, reason)


def _value_at(data: dict[str, object], dotted: str) -> object:
    """The value at ``dotted`` in ``data`` (None where there is none)."""
    value: object = data
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def build_trainer(job: JobConfig) -> TrainerBase:
    """The trainer a job file describes, by what its ``algorithm`` needs (the algorithm table; the
    model is resolved, nothing is started yet).

    An offline algorithm (dpo) -> DPOTrainer on preference pairs; one with a critic (ppo) ->
    PPOTrainer; the others (grpo, rloo, reinforce_pp) -> GRPOTrainer (the same loop; the trainer
    computes each one's advantages).
    """
    from rlfleet.common.schema.algorithms import ALGORITHMS
    from rlfleet.controller.dataset import PromptDataset
    from rlfleet.controller.grpo import GRPOTrainer

    data, config = job.data, job.trainer_config()
    common = {
        "max_prompt_length": job.max_prompt_length, "num_workers": data.num_workers,
        "prompt_key": data.prompt_key, "seed": job.placement.seed, "overlong": data.overlong,
        "system_prompt": data.system_prompt,
    }  # fmt: skip
    algorithm = ALGORITHMS[job.algorithm.name]
    if not algorithm.online:
        from rlfleet.controller.dpo import DPOTrainer
        from rlfleet.controller.preference import PreferenceDataset

        keys = {"chosen_key": data.chosen_key, "rejected_key": data.rejected_key}
        pairs = PreferenceDataset(data.path, max_response_length=job.max_response_length, **keys, **common)
        trainer = DPOTrainer(job.model.name, pairs, config)
        trainer.fleet_run.job = job.masked_dump()
        return trainer
    dataset = PromptDataset(data.path, **common)
    if algorithm.needs_critic:
        from rlfleet.controller.ppo import PPOTrainer

        trainer = PPOTrainer(job.model.name, dataset=dataset, config=config, reward=job.reward.spec)
    else:
        trainer = GRPOTrainer(job.model.name, job.reward.spec, dataset, config)
    if job.rollout_fn:
        from rlfleet.controller.routing import import_rollout_fn

        trainer.set_rollout_fn(import_rollout_fn(job.rollout_fn, job.python_path))
    trainer.fleet_run.job = job.masked_dump()  # config.yaml: this job, which rlfleet train runs again
    return trainer


def train(job: JobConfig) -> int:
    """Run a job to the end; returns the exit code."""
    if job.description:
        print(job.description, flush=True)
    trainer = build_trainer(job)
    trainer.train(num_epochs=job.num_epochs, max_steps=job.max_steps)
    print(f"done: {trainer.global_step} steps, outputs in {trainer.output_dir}", flush=True)
    return 0


def _terminate(signum: int, frame: object) -> None:
    from rlfleet.controller.errors import Terminated

    raise Terminated(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; SIGTERM unwinds like Ctrl-C, so a run stops what it started on the way out."""
    args = build_parser().parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _main(args)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(args, "log_level", "WARNING").upper(),
                        format="%(asctime)s controller %(levelname)s %(name)s: %(message)s")  # fmt: skip
    from rlfleet.common.errors import Failure, UserError
    from rlfleet.controller.errors import Terminated

    if args.command == "status":
        from rlfleet.controller.status import run_status_command

        return run_status_command(args)
    if args.command == "env":
        from rlfleet.controller.env_report import render, report

        print(render(report()), end="")
        return 0
    try:
        if getattr(args, "handler", None) is not None:  # eval, plot: their modules run them
            return args.handler(args)
        if args.command == "config" and (args.fields or args.config is None):
            return _print_fields(args)
        job = _load_job(args.config, args.overrides)
        if args.command == "config":
            print(json.dumps(job.masked_dump(), indent=2))
            return 0
        return train(job)
    except UserError as exc:  # the user's to fix: the reason is enough
        print(f"rlfleet: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Failure as exc:  # a tier died or never came up, a request failed or timed out
        print(f"rlfleet: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        how = str(exc) if isinstance(exc, Terminated) else "interrupted"
        print(f"rlfleet: {how}; every process this run started has been stopped", file=sys.stderr)
        return 128 + exc.signum if isinstance(exc, Terminated) else 130
    # anything else is a crash: it propagates, Python prints its traceback and exits 1


def _print_fields(args: argparse.Namespace) -> int:
    """``rlfleet config --fields``: every key of a job file as YAML (config_fields.py)."""
    from rlfleet.common.errors import ConfigError
    from rlfleet.controller.config import JobConfig
    from rlfleet.controller.config_fields import fields_yaml

    if not args.fields:
        raise ConfigError("config", "", "give a job file (rlfleet config JOB.yaml), or --fields")
    if args.config is not None:
        raise ConfigError("config", str(args.config), "--fields lists every key of any job: give no job file")
    print(fields_yaml(JobConfig), end="")
    return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
