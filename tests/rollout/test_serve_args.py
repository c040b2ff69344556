"""``rlfleet-rollout serve --model PATH``: the flag becomes the ``model_path`` override."""

from __future__ import annotations

import pytest

from rlfleet.common.control.worker import cli_overrides, parse_service_args
from rlfleet.common.schema.config import load_config
from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.rollout.main import model_flag_to_override


@pytest.mark.parametrize("flag", [["--model", "/models/m"], ["--model=/models/m"]])
def test_model_flag_sets_model_path_with_the_common_flags(flag: list[str]) -> None:
    argv = ["serve", *flag, "--nats", "nats://h:4222", "--pool", "long", "--cluster", "job1", "seed=3"]
    args = parse_service_args("rlfleet-rollout", model_flag_to_override(argv))
    config = load_config(RolloutWorkerConfig, None, cli_overrides(args))
    assert (config.model_path, config.nats_url, config.pool, config.cluster, config.seed) == (
        "/models/m", "nats://h:4222", "long", "job1", 3,
    )  # fmt: skip


def test_without_model_flag_argv_is_unchanged() -> None:
    argv = ["serve", "--config", "w.yaml", "model_path=/m"]
    assert model_flag_to_override(argv) == argv
