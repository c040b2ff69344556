"""Every config file under deploy/ is in the nested form: it loads without the previous release's
flat keys (no FutureWarning, no key the loader has to move into its section)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.schema.config import ConfigModel, load_config, read_config_file, section_class
from rlfleet.common.schema.reward import RewardWorkerConfig
from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.controller.config import JobConfig

pytestmark = pytest.mark.timeout(60)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIGS: dict[str, type[ConfigModel]] = {
    "reward.yaml": RewardWorkerConfig,
    "rollout-pool.yaml": RolloutWorkerConfig,
    "kuberay/job.yaml": JobConfig,
}


def _flat_keys(cls: type[ConfigModel], data: dict[str, Any], where: str = "") -> list[str]:
    """The keys of ``data`` (and of its sections') that are ``cls``'s flat form, short forms too."""
    found = [f"{where}{key}" for key in data if key in cls.legacy() and key not in cls.model_fields]
    for key, value in data.items():
        inner = section_class(cls.model_fields[key].annotation) if key in cls.model_fields else None
        if inner is not None and isinstance(value, dict):
            found += _flat_keys(inner, value, f"{where}{key}.")
    return found


def test_every_config_file_is_listed() -> None:
    files = {p.relative_to(DEPLOY).as_posix() for p in DEPLOY.glob("*.yaml")} | {"kuberay/job.yaml"}
    assert files == set(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_config_file_is_nested(name: str) -> None:
    cls = CONFIGS[name]
    assert _flat_keys(cls, read_config_file(DEPLOY / name)) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        load_config(cls, DEPLOY / name)


def test_the_flat_key_finder_finds_flat_keys() -> None:
    flat = {"eval_data": "e.jsonl", "learning_rate": 1e-5, "rollout": {"colocate": True, "engine": "vllm"}}
    assert _flat_keys(JobConfig, flat) == ["eval_data", "learning_rate", "rollout.colocate"]
    assert _flat_keys(RolloutWorkerConfig, {"device": "cuda", "rollout": {"engine": {"type": "hf"}}}) == [
        "device"
    ]
