"""Fixtures of the attack suite, loaded from the suites whose setups it attacks.

``reward_server``, ``rollout_store`` and ``spawn`` (a shared reward server in process, a real
TensorStore, ``rlfleet-reward serve`` processes) come from ``tests/reward/conftest.py``; ``procs``
and ``tiny_model_dir`` (the run's processes, a tiny model) from ``tests/integration/conftest.py``:
both suites test and attack the same setup.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]


def _load(suite: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"rlfleet_{suite}_test_fixtures", TESTS / suite / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_reward, _integration = _load("reward"), _load("integration")
reward_server, rollout_store, spawn = _reward.reward_server, _reward.rollout_store, _reward.spawn
procs, rlfleet_cache, tiny_model_dir = (
    _integration.procs,
    _integration.rlfleet_cache,
    _integration.tiny_model_dir,
)
