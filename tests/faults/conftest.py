"""Fixtures of the fault suite (issue 12): real processes, a real nats-server, faults injected.

``procs``, ``rlfleet_cache``, ``tiny_model_dir``, ``venv_script`` and ``cli_env`` come from
``tests/integration/conftest.py`` (the faults hit the same setup the integration suite runs).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from rlfleet.common.schema.config import merge

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


@pytest.fixture
def serve_tier(tmp_path: Path, venv_script, cli_env) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:  # noqa: ANN001
    """``start(tier, url, config, env=None)``: a real ``rlfleet-<tier> serve`` process on the NATS URL
    with ``config`` (its log next to it in ``tmp_path``); stops exactly the processes it started."""
    started: list[subprocess.Popen[bytes]] = []

    def start(tier: str, url: str, config: dict[str, object], env: dict[str, str] | None = None) -> Any:
        path = tmp_path / f"{tier}-{len(started)}.yaml"
        path.write_text(yaml.safe_dump(merge({"fleet": {"nats_url": url}}, config)))
        command = [venv_script(f"rlfleet-{tier}"), "serve", "--config", str(path)]
        with open(tmp_path / f"{tier}-{len(started)}.log", "wb") as log:
            env = {**cli_env, **(env or {})}
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


class TinyCliRun:
    """The tiny example as a real ``rlfleet train`` command (few steps, small batches, a jsonl log),
    and the steps a run logged: the fault tests that drive the CLI share it."""

    example = TESTS.parent / "examples" / "tiny_grpo.yaml"

    def __init__(self, rlfleet: str, model_dir: Path) -> None:
        self.rlfleet, self.model_dir = rlfleet, model_dir

    def command(self, out: Path, steps: int, *overrides: str) -> list[str]:
        return [self.rlfleet, "train", str(self.example), f"output_dir={out}", f"model.name={self.model_dir}",
                f"max_steps={steps}", "rollout_batch_size=4", "train_batch_size=4", "group_size=4",
                "sample_table_size=0", "log_every=1", *overrides]  # fmt: skip

    @staticmethod
    def steps(out: Path) -> list[int]:
        """The steps ``metrics.jsonl`` holds so far."""
        path = out / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line)["step"] for line in lines if line.strip()]


@pytest.fixture
def tiny_cli(venv_script, tiny_model_dir) -> TinyCliRun:  # noqa: ANN001 (fixtures)
    return TinyCliRun(venv_script("rlfleet"), tiny_model_dir)
