"""The embedded run's own nats-server killed mid-run is started again (issue 12, points 4 and 5).

A real tiny ``rlfleet train`` run (the embedded default: the run starts its own nats-server with
per-role credentials): once two steps are done its nats-server is SIGKILLed (pid from the run's
``processes.json``). The launcher starts it again on the same port with the same configuration,
every client reconnects, and the run finishes all its steps with the same worker processes (none
reaped, none restarted). Past ``faults.restart_budget`` the run stops with a cause naming the
nats-server and the budget, and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _nats(out: Path) -> dict | None:
    try:
        return json.loads((out / "fleet" / "processes.json").read_text())["nats"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


def _kill_nats_when(out: Path, proc: subprocess.Popen[str], ready, timeout: float = 180) -> dict:  # noqa: ANN001
    """SIGKILL the run's nats-server once ``ready()``; wait until the launcher recorded a new one."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not get far enough"
        time.sleep(0.05)
    before = _nats(out)
    assert before is not None
    os.kill(before["pid"], signal.SIGKILL)
    while True:
        after = _nats(out)
        if after is not None and after["pid"] != before["pid"]:
            assert after["url"] == before["url"], "restarted on the same port"
            return after
        if proc.poll() is not None:  # the run ended instead (past its budget)
            return {}
        assert time.monotonic() < deadline, "the nats-server was not started again"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_killed_embedded_nats_server_is_restarted_and_the_run_finishes(
    tmp_path: Path, tiny_cli, cli_env, procs
) -> None:
    out, steps = tmp_path / "run", 6
    command = tiny_cli.command(out, steps, "loggers=[jsonl]")
    proc = subprocess.Popen(command, cwd=REPO, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        after = _kill_nats_when(out, proc, lambda: len(tiny_cli.steps(out)) >= 2)
        workers_before = {k: v for k, v in procs.launched(out).items() if k != "nats-server"}
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    assert f"done: {steps} steps" in stdout
    assert after.get("restarts") == 1
    assert tiny_cli.steps(out) == list(range(1, steps + 1))
    restarted = "starting it again on the same port (restart 1 of"
    assert restarted in stderr
    after_kill = stderr[stderr.index(restarted) :]
    assert " is dead: " not in after_kill, "no worker is reaped while NATS is restarted"
    record = json.loads((out / "fleet" / "processes.json").read_text())
    assert not any(w.get("restarts") for w in record["workers"]), "no worker was restarted"
    assert {w["worker_id"]: w["pid"] for w in record["workers"]} == workers_before
    assert procs.survivors(procs.launched(out)) == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_embedded_nats_server_killed_past_the_restart_budget_stops_the_run_naming_it(
    tmp_path: Path, tiny_cli, cli_env, procs
) -> None:
    out = tmp_path / "run"
    command = tiny_cli.command(out, 40, "loggers=[jsonl]", "faults.restart_budget=1")
    proc = subprocess.Popen(command, cwd=REPO, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        first = _kill_nats_when(out, proc, lambda: len(tiny_cli.steps(out)) >= 1)
        assert first.get("restarts") == 1
        _kill_nats_when(out, proc, lambda: True)
        pids = procs.launched(out)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("rlfleet: ") and "nats-server" in last, last
    assert "restart budget is spent (1 of faults.restart_budget=1 restarts used)" in last, last
    assert procs.survivors(pids, timeout=20) == []
