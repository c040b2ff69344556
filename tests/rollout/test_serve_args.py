"""``rlfleet-rollout serve --model PATH``: the flag becomes the ``model_path`` override."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlfleet.common.control.worker import cli_overrides, parse_service_args
from rlfleet.common.schema.config import load_config
from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.rollout.main import model_flag_to_override


@pytest.mark.parametrize("flag", [["--model", "/models/m"], ["--model=/models/m"]])
def test_model_flag_sets_model_path_with_the_common_flags(flag: list[str]) -> None:
    argv = ["serve", *flag, "--nats", "nats://h:4222", "--pool", "long", "--cluster", "job1",
            "placement.seed=3"]  # fmt: skip
    args = parse_service_args("rlfleet-rollout", model_flag_to_override(argv))
    config = load_config(RolloutWorkerConfig, None, cli_overrides(args))
    fleet = config.fleet
    assert (config.model_path, fleet.nats_url, config.pool, fleet.cluster, config.placement.seed) == (
        "/models/m", "nats://h:4222", "long", "job1", 3,
    )  # fmt: skip


FILE_AUTH = {"password": "pw-from-file"}
FLAT = {"nats_url": "nats://file:4222", "cluster": "file", "nats_auth": FILE_AUTH, "model_path": "/m",
        "device": "cpu"}  # fmt: skip
NESTED = {"fleet": {"nats_url": "nats://file:4222", "cluster": "file", "nats_auth": FILE_AUTH},
          "model_path": "/m", "placement": {"device": "cpu"}}  # fmt: skip


@pytest.mark.parametrize("data", [FLAT, NESTED], ids=["flat", "nested"])
def test_the_flags_win_over_a_config_file_of_either_form(data: dict[str, object], tmp_path: Path) -> None:
    """``--nats``, ``--cluster`` and ``--nats-user`` set the nested fields over a file of the previous
    release's flat form as over a nested one; the file's other credentials stay beside the flag's."""
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump(data))
    argv = ["serve", "--config", str(path), "--nats", "nats://flag:4222", "--cluster", "job1",
            "--nats-user", "rollout", "seed=5"]  # fmt: skip
    args = parse_service_args("rlfleet-rollout", argv)
    config = load_config(RolloutWorkerConfig, args.config, cli_overrides(args))
    fleet = config.fleet
    assert (fleet.nats_url, fleet.cluster, fleet.nats_auth.user) == ("nats://flag:4222", "job1", "rollout")
    assert fleet.nats_auth.password.get_secret_value() == "pw-from-file"
    assert (config.placement.device, config.placement.seed) == ("cpu", 5)


def test_without_model_flag_argv_is_unchanged() -> None:
    argv = ["serve", "--config", "w.yaml", "model_path=/m"]
    assert model_flag_to_override(argv) == argv
