"""A run SIGTERMed mid-step stops cleanly (issue 12): one line, its documented exit code, no process left.

A real tiny ``rlfleet train`` run with ``save_every=2`` gets SIGTERM once a few steps are done (the
steps take well under a second, so the signal lands in one). The CLI documents 143 (128 + SIGTERM)
and one ``rlfleet: terminated by SIGTERM`` line; no traceback may follow it (tasks left pending
when the run's event loop closed printed "Event loop is closed", "Writer is closed"), and the
launcher must not kill a worker for draining longer than it waited ("did not stop in 10s"). Every
process the run started is gone, and ``resume_from=auto`` finishes the run from its checkpoint.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlfleet.controller.checkpoints import latest_checkpoint

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sigterm_mid_run_exits_143_with_one_line_and_resumes(
    tmp_path: Path, tiny_cli, cli_env, procs
) -> None:
    out = tmp_path / "run"
    command = tiny_cli.command(out, STEPS, "save_every=2", "loggers=[jsonl,tensorboard]")
    proc = subprocess.Popen(command, cwd=REPO, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while latest_checkpoint(out) is None or len(tiny_cli.steps(out)) < 3:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.05)
        pids = procs.launched(out)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "did not stop" not in stderr, stderr[-3000:]
    assert "Event loop is closed" not in stderr and "Writer is closed" not in stderr, stderr[-3000:]
    assert stderr.count("rlfleet: terminated by SIGTERM") == 1, stderr[-3000:]
    assert procs.survivors(pids, timeout=10) == [], f"every process of the run is gone ({took:.1f} s to stop)"
    assert max(tiny_cli.steps(out)) < STEPS, "the signal must land before the run's end"

    saved = int(latest_checkpoint(out).name.removeprefix("checkpoint-"))  # type: ignore[union-attr]
    again = subprocess.run([*command, "resume_from=auto"], cwd=REPO, env=cli_env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"done: {STEPS} steps" in again.stdout
    assert tiny_cli.steps(out)[-(STEPS - saved) :] == list(range(saved + 1, STEPS + 1))
    assert procs.survivors(procs.launched(out)) == []
