"""Fixtures for integration tests that start real rlfleet processes.

``procs`` answers which processes a run started (the launcher writes them to
``<output_dir>/fleet/processes.json``) and whether any is still alive; ``venv_script`` finds a
console script of this environment (next to the interpreter: no ``uv run`` inside tests);
``tiny_model_dir`` is a tiny random-init model built once per session.

The tests here that join two tiers (a controller against a real reward or trainer worker, the
trainer's buckets loaded by the rollout engine) use the fixtures of those tiers' own suites,
loaded from their conftest files (``make_tiny_rm``, ``reward_server``, ``rollout_store``,
``spawn``; ``make_vllm_checkpoint``; the trainer's tiny Llama as ``trainer_model_dir`` and
``make_batch``): each ``tests/<package>`` needs only its own package (``scripts/isolated_tests.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _suite(name: str) -> ModuleType:
    """``tests/<name>/conftest.py`` as a module of its own (its fixtures, for the tests that join tiers)."""
    spec = importlib.util.spec_from_file_location(
        f"rlfleet_{name}_suite_fixtures", REPO / "tests" / name / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (loading the trainer's also puts tests/trainer on sys.path: test_fleet_trainer_retries imports test_worker)
_reward, _rollout, _trainer = _suite("reward"), _suite("rollout"), _suite("trainer")
make_tiny_rm, reward_server, rollout_store, spawn = (
    _reward.make_tiny_rm,
    _reward.reward_server,
    _reward.rollout_store,
    _reward.spawn,
)
make_vllm_checkpoint = _rollout.make_vllm_checkpoint
trainer_model_dir, make_batch = _trainer.tiny_model_dir, _trainer.make_batch


class ProcessProbe:
    """Liveness of process ids, and the pids an embedded run recorded."""

    @staticmethod
    def alive(pid: int) -> bool:
        """True while ``pid`` runs (a zombie waiting for its parent counts as gone)."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return False
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")

    @staticmethod
    def launched(output_dir: Path) -> dict[str, int]:
        """``{worker_id or 'nats-server': pid}`` from the run's ``processes.json``."""
        data = json.loads((Path(output_dir) / "fleet" / "processes.json").read_text())
        pids = {w["worker_id"]: int(w["pid"]) for w in data["workers"]}
        if data.get("nats"):
            pids["nats-server"] = int(data["nats"]["pid"])
        return pids

    def survivors(self, pids: list[int] | dict[str, int], timeout: float = 5.0) -> list[int]:
        """The pids still alive after waiting up to ``timeout`` s for them to go."""
        wanted = list(pids.values()) if isinstance(pids, dict) else list(pids)
        deadline = time.monotonic() + timeout
        while True:
            left = [pid for pid in wanted if self.alive(pid)]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)


@pytest.fixture
def procs() -> ProcessProbe:
    return ProcessProbe()


@pytest.fixture(scope="session")
def venv_script() -> Callable[[str], str]:
    def find(name: str) -> str:
        path = Path(sys.executable).parent / name
        assert path.exists(), f"{name} is not installed next to {sys.executable}"
        return str(path)

    return find


@pytest.fixture(scope="session")
def rlfleet_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``RLFLEET_CACHE`` of this session: models built by the tests and by their subprocesses."""
    return tmp_path_factory.mktemp("rlfleet-cache")


@pytest.fixture(scope="session")
def tiny_model_dir(rlfleet_cache: Path) -> Path:
    """``tiny:digits`` with seed 0, as the tiny example builds it (subprocesses find it cached)."""
    from rlfleet.controller.models import resolve_model

    return resolve_model("tiny:digits", cache_dir=rlfleet_cache / "models", seed=0)


@pytest.fixture
def cli_env(rlfleet_cache: Path) -> dict[str, str]:
    """Environment for ``rlfleet`` subprocesses: this session's model cache, no W&B network."""
    return {
        **os.environ,
        "RLFLEET_CACHE": str(rlfleet_cache),
        "WANDB_MODE": "offline",
        "PYTHONUNBUFFERED": "1",
    }
