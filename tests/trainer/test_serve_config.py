"""``rlfleet-trainer serve --config``: every rank reads the shared ``TrainerWorkerConfig``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlfleet.common.schema.config import legacy_dump, load_config
from rlfleet.common.schema.trainer import AlgorithmSettings, StepSettings, TrainerWorkerConfig, UpdateSettings
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


NESTED = {
    "model_path": "/models/m", "weights_store_mb": 512,
    "model": {"sharding": "full", "trust_remote_code": True},
    "step": {
        "algorithm": {"name": "ppo", "critic_learning_rate": 1e-5}, "update": {"learning_rate": 3e-6},
        "batch": {"rollout_batch_size": 8, "train_batch_size": 4},
    },
    "fleet": {"nats_url": "nats://fleet:4222", "cluster": "c1"},
    "placement": {"device": "cpu", "seed": 7},
    "tensor_plane": {"bind_host": "0.0.0.0"},
}  # fmt: skip
FLAT = {  # the same config in the previous release's form: every setting a top-level key
    "model_path": "/models/m", "weights_store_mb": 512, "sharding": "full", "trust_remote_code": True,
    "algorithm": "ppo", "critic_learning_rate": 1e-5, "learning_rate": 3e-6, "rollout_batch_size": 8,
    "train_batch_size": 4, "nats_url": "nats://fleet:4222", "cluster": "c1", "device": "cpu", "seed": 7,
    "bind_host": "0.0.0.0",
}  # fmt: skip


def test_a_worker_config_holds_its_model_settings_and_default_step_settings(tmp_path: Path) -> None:
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump(NESTED))
    config = load_config(TrainerWorkerConfig, path, ["step.update.micro_batch_size=4"])
    assert (config.model.sharding, config.weights_store_mb, config.step.update.micro_batch_size) == (
        "full",
        512,
        4,
    )
    own = StepSettings.of(config)  # what a step that carries no settings trains with
    assert (own.algorithm.name, own.update.learning_rate, own.algorithm.critic_learning_rate) == (
        "ppo",
        3e-6,
        1e-5,
    )
    assert (own.update.micro_batch_size, own.batch.num_updates) == (4, 2)
    assert (config.fleet.nats_url, config.fleet.cluster) == ("nats://fleet:4222", "c1")
    assert (config.placement.device, config.placement.seed, config.tensor_plane.bind_host) == (
        "cpu",
        7,
        "0.0.0.0",
    )


def test_a_worker_config_in_the_previous_releases_flat_form_loads_into_its_sections(tmp_path: Path) -> None:
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text(yaml.safe_dump(FLAT))
    nested.write_text(yaml.safe_dump(NESTED))
    config = load_config(TrainerWorkerConfig, flat, ["micro_batch_size=4"])  # a flat override too
    assert config == load_config(TrainerWorkerConfig, nested, ["step.update.micro_batch_size=4"])
    assert (config.model.sharding, config.model.trust_remote_code) == ("full", True)
    step = config.step
    assert (step.algorithm.name, step.algorithm.critic_learning_rate) == ("ppo", 1e-5)
    assert (step.update.learning_rate, step.update.micro_batch_size) == (3e-6, 4)
    assert (step.batch.rollout_batch_size, step.batch.train_batch_size) == (8, 4)
    assert (config.fleet.nats_url, config.fleet.cluster) == ("nats://fleet:4222", "c1")
    assert (config.placement.device, config.placement.seed, config.tensor_plane.bind_host) == (
        "cpu",
        7,
        "0.0.0.0",
    )
    # and back to that form, as a controller writes it for a trainer of the previous release
    assert legacy_dump(config) == {**FLAT, "micro_batch_size": 4}
    # step settings given flat (as on the wire) nest the same way
    assert StepSettings(micro_batch_size=4, kl_coef=0.0, algorithm="rloo") == StepSettings(
        algorithm=AlgorithmSettings(name="rloo"), update=UpdateSettings(micro_batch_size=4, kl_coef=0.0)
    )
