"""The controller SIGKILLed mid-run, then ``resume_from=auto`` (issue 12, point 5).

A real tiny ``rlfleet train`` run with ``save_every=2``: once a checkpoint is written the
controller is killed outright. Its workers go with it (the kernel's parent-death signal), no
half-written state file is left (each is written atomically), and the same command with
``resume_from=auto`` continues from the latest complete checkpoint to the last step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlfleet.controller.checkpoints import latest_checkpoint

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"
STEPS = 8


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_from_auto_continues_a_run_whose_controller_was_killed(
    tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    out = tmp_path / "run"
    command = [venv_script("rlfleet"), "train", str(EXAMPLE), f"output_dir={out}", f"model={tiny_model_dir}",
               f"max_steps={STEPS}", "save_every=2", "rollout_batch_size=4", "train_batch_size=4",
               "group_size=4", "sample_table_size=0", "log_every=1", "loggers=[jsonl]"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=REPO, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while latest_checkpoint(out) is None or len(_steps(out)) < 3:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 150 s"
            time.sleep(0.05)
        pids = procs.launched(out)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert procs.survivors(pids, timeout=40) == [], "the workers go with their controller"
    killed_at = max(_steps(out))
    assert killed_at < STEPS, "the kill must land before the run's end"
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None
    saved = int(checkpoint.name.removeprefix("checkpoint-"))
    assert saved % 2 == 0 and saved <= killed_at
    assert not list(out.rglob("*.tmp")), "no state file is left half-written"

    again = subprocess.run([*command, "resume_from=auto"], cwd=REPO, env=cli_env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"done: {STEPS} steps" in again.stdout
    # the resumed run goes on after the checkpoint, and metrics.jsonl keeps the steps before it (issue 29)
    assert _steps(out) == list(range(1, STEPS + 1)), "each step once: the first run's up to the checkpoint"
    state = json.loads((out / f"checkpoint-{STEPS}" / "controller_state.json").read_text())
    assert state["global_step"] == STEPS
    assert procs.survivors(procs.launched(out)) == []
