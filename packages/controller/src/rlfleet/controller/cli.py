"""The ``rlfleet`` command line: ``rlfleet train CONFIG.yaml [a.b=c ...]``.

Heavy modules (torch, transformers) are imported only once a command runs, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet", description="RL post-training of LLMs over a fleet of services")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job from a YAML/TOML config")
    train.add_argument("config", type=Path, help="job config (see examples/)")
    train.add_argument("overrides", nargs="*", help="config overrides: a.b.c=value")
    train.add_argument("--log-level", default="WARNING", help="controller log level (default WARNING)")
    show = sub.add_parser("config", help="print the resolved config of a job file and exit")
    show.add_argument("config", type=Path)
    show.add_argument("overrides", nargs="*")
    return parser


def _load_job(path: Path, overrides: Sequence[str]):  # -> JobConfig
    from rlfleet.common.config import load_config
    from rlfleet.controller.config import JobConfig

    job = load_config(JobConfig, path, list(overrides))
    data_path = Path(job.data.path)
    if not data_path.is_absolute() and not data_path.exists() and (path.parent / data_path).exists():
        job.data.path = str(path.parent / data_path)
    return job


def train(job) -> int:  # job: JobConfig
    from rlfleet.controller.dataset import PromptDataset
    from rlfleet.controller.grpo import GRPOTrainer

    if job.description:
        print(job.description, flush=True)
    dataset = PromptDataset(
        job.data.path,
        max_prompt_length=job.data.max_prompt_length or job.max_prompt_length,
        num_workers=job.data.num_workers,
        prompt_key=job.data.prompt_key,
        seed=job.seed,
        overlong=job.data.overlong,
        system_prompt=job.data.system_prompt,
    )
    trainer = GRPOTrainer(job.model, job.reward, dataset, job.trainer_config())
    trainer.train(num_epochs=job.num_epochs, max_steps=job.max_steps)
    print(f"done: {trainer.global_step} steps, outputs in {trainer.output_dir}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING").upper(),
                        format="%(asctime)s controller %(levelname)s %(name)s: %(message)s")  # fmt: skip
    from rlfleet.common.errors import ConfigError
    from rlfleet.controller.errors import DatasetError, ModelNotFound, TierDied

    try:
        job = _load_job(args.config, args.overrides)
        if args.command == "config":
            print(job.model_dump_json(indent=2))
            return 0
        return train(job)
    except (ConfigError, DatasetError, ModelNotFound) as exc:
        print(f"rlfleet: {exc}", file=sys.stderr)
        return 2
    except TierDied as exc:
        print(f"rlfleet: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rlfleet: interrupted; every process this run started has been stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
