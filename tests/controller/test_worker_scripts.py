"""What the embedded launcher starts for a tier, and what it writes in the worker's config file.

``RLFLEET_<TIER>_SCRIPT`` names another program for a tier's console script (tests/compat runs an
older release's tiers this way); a worker's config file holds only the settings that differ from
their defaults, so an older worker that refuses unknown settings still reads it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.controller.launcher import WorkerSpec, find_script, script_variable


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
    config = RolloutWorkerConfig(model_path="/models/m", cluster="c", seed=0, trust_remote_code=False)
    written = WorkerSpec("rollout", "rollout-0", config).config_data("nats://127.0.0.1:4222")
    assert written == {"model_path": "/models/m", "cluster": "c", "seed": 0, "nats_url": "nats://127.0.0.1:4222",
                       "worker_id": "rollout-0"}  # fmt: skip
    assert RolloutWorkerConfig.model_validate(written).trust_remote_code is False
    trusting = RolloutWorkerConfig(model_path="/models/m", trust_remote_code=True)
    assert WorkerSpec("rollout", "r", trusting).config_data("nats://h:1")["trust_remote_code"] is True
