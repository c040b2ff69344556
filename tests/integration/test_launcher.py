"""The embedded launcher with stand-in worker processes: death reports, pid records, clean stops.

The workers here are one-line Python programs (``WorkerSpec.command``) so the tests take seconds;
the real tiers go through the same code in test_failures.py.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from rlfleet.controller.errors import TierDied
from rlfleet.controller.launcher import EmbeddedFleet, WorkerSpec, last_error_line

TRACEBACK = """\
2026-01-01 10:00:00,000 rlfleet-reward INFO rlfleet.common.control.worker: starting
Traceback (most recent call last):
  File "/x/service.py", line 1, in setup
    raise UnknownReward(name, known)
rlfleet.reward.errors.UnknownReward: unknown reward 'nosuch': registered rules are charset, concise
"""

# A worker that starts a grandchild, prints its pid, ignores SIGTERM and sleeps: stop() must
# escalate to SIGKILL and take the grandchild with it.
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print('grandchild', child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _wait_for_line(path: Path, prefix: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith(prefix):
                return line
        time.sleep(0.05)
    raise AssertionError(f"{path} never printed {prefix!r}")


def test_last_error_line_finds_the_exception_and_drops_its_module_path() -> None:
    assert last_error_line(TRACEBACK) == (
        "UnknownReward: unknown reward 'nosuch': registered rules are charset, concise"
    )
    assert last_error_line("loading\nout of disk space\n\n") == "out of disk space"
    assert last_error_line("") == ""


def test_tier_died_message_names_tier_worker_code_cause_and_log() -> None:
    died = TierDied("reward", "reward-0", 1, error="UnknownReward: nope", log_path="/runs/x/reward-0.log")
    assert (
        str(died)
        == "reward worker reward-0 exited with code 1: UnknownReward: nope (log: /runs/x/reward-0.log)"
    )
    killed = TierDied("trainer", "trainer-0", -signal.SIGKILL)
    assert str(killed) == "trainer worker trainer-0 was killed by signal SIGKILL (exit code -9)"


@pytest.mark.timeout(60)
def test_crashed_worker_is_reported_with_its_error_line(tmp_path: Path, procs) -> None:
    with EmbeddedFleet(tmp_path) as fleet:
        fleet.start_nats()
        worker = fleet.spawn(WorkerSpec("reward", "reward-0", {}, command=_python("raise KeyError('spec')")))
        deadline = time.monotonic() + 20
        with pytest.raises(TierDied) as caught:
            while time.monotonic() < deadline:
                fleet.check()
                time.sleep(0.05)
        assert caught.value.returncode == 1 and caught.value.error == "KeyError: 'spec'"
        assert str(worker.log_path) in str(caught.value)
        recorded = json.loads((tmp_path / "processes.json").read_text())
        assert recorded["workers"] == [
            {"tier": "reward", "worker_id": "reward-0", "pid": worker.pid, "log": str(worker.log_path)}
        ]
        assert recorded["nats"]["pid"] == fleet.processes.nats.pid
        nats_pid = fleet.processes.nats.pid
    assert procs.survivors([nats_pid]) == []


@pytest.mark.timeout(60)
def test_stop_kills_a_worker_ignoring_sigterm_and_whatever_it_started(tmp_path: Path, procs) -> None:
    fleet = EmbeddedFleet(tmp_path)
    try:
        fleet.start_nats()
        worker = fleet.spawn(WorkerSpec("rollout", "rollout-0", {}, command=_python(STUBBORN)))
        grandchild = int(_wait_for_line(worker.log_path, "grandchild").split()[1])
        pids = [*fleet.pids, grandchild]
        assert all(procs.alive(pid) for pid in pids)
        fleet.check()  # all alive: nothing to report
        t0 = time.monotonic()
        fleet.stop(timeout=1.0)
        assert time.monotonic() - t0 < 15
    finally:
        fleet.stop()
    assert fleet.pids == []
    assert procs.survivors(pids) == []
