"""``rlfleet-trainer serve --config``: every rank reads the shared ``TrainerWorkerConfig``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlfleet.common.schema.config import load_config
from rlfleet.common.schema.trainer import StepSettings, TrainerWorkerConfig
from rlfleet.trainer.main import main


@pytest.mark.parametrize("rank", ["0", "1"])
def test_each_rank_refuses_a_field_the_worker_config_does_not_have(
    rank: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", rank)  # rank 0 serves NATS, the others follow it
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump({"model_path": "/models/m", "store_capacity_mb": 64}))
    assert main(["serve", "--config", str(path)]) == 2
    assert "store_capacity_mb" in capsys.readouterr().err


def test_a_worker_config_holds_its_model_settings_and_default_step_settings(tmp_path: Path) -> None:
    path = tmp_path / "trainer.yaml"
    fields = {"model_path": "/models/m", "algorithm": "ppo", "sharding": "full", "learning_rate": 3e-6,
              "critic_learning_rate": 1e-5, "weights_store_mb": 512}  # fmt: skip
    path.write_text(yaml.safe_dump(fields))
    config = load_config(TrainerWorkerConfig, path, ["micro_batch_size=4"])
    assert (config.sharding, config.weights_store_mb, config.micro_batch_size) == ("full", 512, 4)
    own = StepSettings.of(config)  # what a step that carries no settings trains with
    assert (own.algorithm, own.learning_rate, own.critic_learning_rate) == ("ppo", 3e-6, 1e-5)
