"""What a new user's console says (issue 35, point 2), piece by piece: the line naming the workers
a run starts, ``KL: off`` in a run without a KL term, third-party progress bars hidden, and the
controller's own TensorStore started once however many ask at once (a second one, never stopped,
ended ``rlfleet eval`` with a gRPC "Event loop is closed" traceback). The whole console of a tiny
run is checked in tests/integration/test_day_one_console.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from rlfleet.common.schema.worker import TensorPlaneSettings
from rlfleet.controller.launcher import WorkerSpec, starting_line
from rlfleet.controller.loggers import ConsoleProgress, progress_line
from rlfleet.controller.own_store import OwnStore


def test_the_starting_line_names_every_worker() -> None:
    specs = [WorkerSpec("trainer", "trainer-0", {}), WorkerSpec("rollout", "rollout-0", {}),
             WorkerSpec("rollout", "fast-0", {}), WorkerSpec("reward", "reward-0", {})]  # fmt: skip
    assert starting_line(specs) == "starting 4 workers: trainer-0, rollout-0, fast-0 (rollout), reward-0"
    assert starting_line(specs[:1]) == "starting 1 worker: trainer-0"


def test_kl_reads_off_when_the_run_has_no_kl_term(capsys: pytest.CaptureFixture[str]) -> None:
    metrics = {"loss": 0.5, "reward/mean": 0.25, "response_length": 9.0}
    assert "| KL: off |" in progress_line(1, 1, 3, 10, metrics, kl_off=True)
    assert "| KL: n/a |" in progress_line(1, 1, 3, 10, metrics)  # a KL term whose step did not report it
    assert "| KL: 0.0123 |" in progress_line(1, 1, 3, 10, {**metrics, "kl": 0.0123}, kl_off=True)
    bar = ConsoleProgress(2, 1, 1, kl_off=True)
    bar.update(1, 1, metrics)
    bar.close()
    assert "| KL: off |" in capsys.readouterr().out


def test_third_party_bars_are_hidden_here_and_in_the_processes_started() -> None:
    code = (
        "import os, transformers.utils.logging as t, huggingface_hub.utils as h\n"
        "from rlfleet.controller.progress_bars import hide_third_party_bars\n"
        "assert t.is_progress_bar_enabled() and not h.are_progress_bars_disabled()\n"
        "hide_third_party_bars()\n"
        "assert not t.is_progress_bar_enabled() and h.are_progress_bars_disabled()\n"
        "import subprocess, sys\n"  # a process it starts reads the variables when it imports them
        "child = 'import transformers.utils.logging as t; print(t.is_progress_bar_enabled())'\n"
        "out = subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout\n"
        "print(out.strip())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("DISABLE_PROGRESS_BARS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_user_who_asks_for_the_bars_keeps_them() -> None:
    code = (
        "import transformers.utils.logging as t\n"
        "from rlfleet.controller.progress_bars import hide_third_party_bars\n"
        "hide_third_party_bars()\n"
        "print(t.is_progress_bar_enabled())\n"
    )
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


@pytest.mark.timeout(60)
async def test_the_own_store_starts_one_server_however_many_ask_at_once() -> None:
    store = OwnStore(TensorPlaneSettings(), listen_all=False)
    try:
        servers = await asyncio.gather(*(store.get() for _ in range(3)))
        assert servers[0] is servers[1] is servers[2] is store.server
    finally:
        await store.stop()
    assert store.server is None
