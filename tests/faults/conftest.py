"""Fixtures of the fault suite (issue 12): real processes, a real nats-server, faults injected.

``procs``, ``rlfleet_cache``, ``tiny_model_dir``, ``venv_script`` and ``cli_env`` come from
``tests/integration/conftest.py`` (the faults hit the same setup the integration suite runs).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]


def _load(suite: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"rlfleet_{suite}_fault_fixtures", TESTS / suite / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_integration = _load("integration")
procs, rlfleet_cache, tiny_model_dir = (
    _integration.procs,
    _integration.rlfleet_cache,
    _integration.tiny_model_dir,
)
venv_script, cli_env = _integration.venv_script, _integration.cli_env
