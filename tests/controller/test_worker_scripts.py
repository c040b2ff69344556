"""What the embedded launcher starts for a tier, and what it writes in the worker's config file.

``RLFLEET_<TIER>_SCRIPT`` names another program for a tier's console script (tests/compat runs an
older release's tiers this way); a worker's config file holds only the settings that differ from
their defaults, in the previous release's flat form, so an older worker that refuses unknown
settings still reads it (and a worker of this release reads it to the same config).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.common.schema.reward import RewardWorkerConfig
from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.common.schema.trainer import TrainerWorkerConfig
from rlfleet.common.schema.worker import FleetAddress
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.launcher import WorkerSpec, find_script, script_variable
from rlfleet.controller.worker_configs import worker_specs


def test_a_tier_script_variable_points_the_launcher_at_another_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert script_variable("rlfleet-rollout") == "RLFLEET_ROLLOUT_SCRIPT"
    monkeypatch.delenv("RLFLEET_ROLLOUT_SCRIPT", raising=False)
    monkeypatch.delenv(script_variable("rlfleet"), raising=False)
    # the controller's own console script: the one tests/controller can count on (it runs alone)
    assert find_script("rlfleet") == str(Path(sys.executable).parent / "rlfleet")
    program = tmp_path / "old-rollout"
    program.write_text("#!/bin/sh\n")
    monkeypatch.setenv("RLFLEET_ROLLOUT_SCRIPT", str(program))
    with pytest.raises(FileNotFoundError, match="RLFLEET_ROLLOUT_SCRIPT=.*is not an executable file"):
        find_script("rlfleet-rollout")  # not executable
    program.chmod(0o755)
    assert find_script("rlfleet-rollout") == str(program)
    assert find_script("rlfleet") == str(Path(sys.executable).parent / "rlfleet")  # others unchanged
    monkeypatch.setenv("RLFLEET_ROLLOUT_SCRIPT", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="missing"):
        find_script("rlfleet-rollout")


def test_a_worker_config_file_holds_only_the_settings_that_differ_from_their_defaults() -> None:
    config = RolloutWorkerConfig(model_path="/models/m", fleet={"cluster": "c"}, placement={"seed": 0},
                                 loading={"trust_remote_code": False})  # fmt: skip
    written = WorkerSpec("rollout", "rollout-0", config).config_data("nats://127.0.0.1:4222")
    assert written == {"model_path": "/models/m", "cluster": "c", "seed": 0, "nats_url": "nats://127.0.0.1:4222",
                       "worker_id": "rollout-0"}  # fmt: skip
    assert RolloutWorkerConfig.model_validate(written).loading.trust_remote_code is False
    trusting = RolloutWorkerConfig(model_path="/models/m", loading={"trust_remote_code": True})
    assert WorkerSpec("rollout", "r", trusting).config_data("nats://h:1")["trust_remote_code"] is True


def _flat(written: dict[str, Any]) -> bool:
    """Whether a config file is in the previous release's flat form: no section is a mapping."""
    sections = {"fleet", "placement", "tensor_plane", "loading", "rollout", "model", "step", "engine"}
    return not any(isinstance(written.get(name), dict) for name in sections)


def test_each_tier_s_config_file_is_the_previous_release_s_flat_form(tmp_path: Path) -> None:
    engine = {
        "type": "vllm",
        "max_model_len": 1024,
        "enable_prefix_caching": False,
        "tensor_parallel_size": 2,
    }
    config = TrainerConfig(
        algorithm={"name": "ppo", "lam": 0.9}, learning_rate=1e-5, kl_coef=0.2, device="cpu", seed=3,
        model={"trust_remote_code": True, "mixed_precision": "none"}, output_dir=str(tmp_path),
        rollout={"engine": engine, "dtype": "bfloat16"}, tensor_plane={"bind_host": "0.0.0.0"},
        reward={"endpoint": "e"},
    )  # fmt: skip
    specs = {
        s.tier: s for s in worker_specs(config, Path("/models/m"), "c1", online=True, reward_spec="concise")
    }
    written = {tier: yaml.safe_load(yaml.safe_dump(s.config_data("nats://h:1"))) for tier, s in specs.items()}
    assert all(_flat(data) for data in written.values()), written
    trainer, rollout, reward = written["trainer"], written["rollout"], written["reward"]
    assert {k: trainer[k] for k in ("algorithm", "lam", "learning_rate", "kl_coef", "device", "seed")} == {
        "algorithm": "ppo", "lam": 0.9, "learning_rate": 1e-5, "kl_coef": 0.2, "device": "cpu", "seed": 3,
    }  # fmt: skip
    assert [trainer[k] for k in ("trust_remote_code", "mixed_precision", "bind_host")] == [
        True,
        "none",
        "0.0.0.0",
    ]
    keys = ("engine", "max_cache_len", "cache_policy", "tensor_parallel_size", "dtype")
    assert {k: rollout[k] for k in keys} == {
        "engine": "vllm", "max_cache_len": 1024, "cache_policy": "none", "tensor_parallel_size": 2,
        "dtype": "bfloat16",
    }  # fmt: skip
    assert (rollout["trust_remote_code"], rollout["cluster"], rollout["seed"]) == (True, "c1", 3)
    assert (reward["trust_remote_code"], reward["cluster"], reward["bind_host"]) == (True, "c1", "0.0.0.0")
    assert reward["endpoints"] == {"e": {"spec": "concise"}} and "nats_auth" not in reward
    # a worker of this release reads the flat form to the config the run built
    assert TrainerWorkerConfig.model_validate(trainer) == specs["trainer"].config.model_copy(
        update={"fleet": FleetAddress(nats_url="nats://h:1", cluster="c1")}
    )
    assert RewardWorkerConfig.model_validate(reward).loading.trust_remote_code is True
    read = RolloutWorkerConfig.model_validate(rollout)
    assert (
        read.rollout == specs["rollout"].config.rollout
        and read.placement == specs["rollout"].config.placement
    )
