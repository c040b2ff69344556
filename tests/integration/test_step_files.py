"""One GRPO step passes through at most 52 source files, and ARCHITECTURE.md lists them.

Issue 10 cut a step to 40 files; issues 12-15 raised it to 59 with fault handling (supervision,
retries, the stall watchdog, worker activity, sampling bounds, the reply cache, deadlines, lost
chunks), worker metrics, wire checks across releases and the packed forward of a prompt's rows, and
seven of those were halves of files split only to stay under 400 lines. Issue 28 made the rule "one
idea per file" and merged back what was one idea (the NATS transport's three files, membership and
heartbeats, fleet and dispatch, the launcher with its processes and nats-server, the tensor codec
and its protobuf framing, a worker and its in-flight work, request deadlines and retries,
membership and the wire-version check of its messages), and gave
each algorithm one file and the policy's forward one module. Issue 30 added two ideas to the step:
``controller/rollout_ahead.py`` (the rollouts a pipelined run begins ahead, which a synchronous
step asks for its own and finds none) and the trainer's ``algorithms/off_policy.py`` (every step
with engine logprobs reports the trainer-vs-engine mismatch, and weights the loss by it when a run
asks). Issue 31 made each policy loss a file of its own (``update.policy_loss``), so the step's
loss, PPO's clipped surrogate, moved out of ``algorithms/grpo.py`` into
``algorithms/policy_losses/ppo_clip.py``. Issue 32 made every weight load verified: the trainer
hashes the version it publishes and each rollout worker what it loaded
(``common/tensors/weight_sync.py``, which also holds the delta a delta-synced run sends), so a
worker that does not serve the published weights is refused instead of trusted. Issue 35 gave the
library its users' habits, and each is part of a step they run: ``controller/trainer_base.py`` hands
every step out to the user's loop (``rlfleet train`` drives the same loop) after telling the user's
callbacks (``controller/callbacks.py``, TRL's ``on_step_end``), and ``controller/lr_schedule.py``
sets the step's learning rate (constant, linear or cosine with warm-up; a step without it would
train at a rate nobody asked for). A file more than 52 is a design change to argue for here, not a
number to bump.

The tiny GRPO example runs as a user runs it (``rlfleet train``, every tier a process) for 4
steps, with a profiler in every process (``step_trace/sitecustomize.py`` notes when each rlfleet
source file is called). ``metrics.jsonl`` stamps when each step ended, so step 3 is the time
between the second and the third stamp (no start-up in it, no final save): the files called in
that window, in any process, are the files one step passes through (the heartbeats that keep the
fleet alive meanwhile included).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACE = Path(__file__).parent / "step_trace"
LIMIT = 52

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _files_of_step(tmp_path: Path, steps: int = 4) -> list[str]:
    out = tmp_path / "trace"
    out.mkdir()
    env = {**os.environ, "RLFLEET_TRACE_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(TRACE), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    run = tmp_path / "run"
    job = str(ROOT / "examples" / "tiny_grpo.yaml")
    command = [sys.executable, "-m", "rlfleet.controller.cli", "train", job, f"max_steps={steps}",
               f"output_dir={run}", "loggers=[jsonl]", "sample_table_size=0"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    stamps = [json.loads(line)["time"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    start, end = int(stamps[1] * 20) + 1, int(stamps[2] * 20)  # step 3: no start-up, no final save
    touched: set[str] = set()
    for path in out.glob("*.json"):
        for name, bins in json.loads(path.read_text()).items():
            if any(start <= b <= end for b in bins):
                touched.add(_source_name(name))
    return sorted(touched)


def _source_name(path: str) -> str:
    """``packages/<pkg>/src/rlfleet/...`` -> ``rlfleet/...`` (the name ARCHITECTURE.md uses)."""
    return "rlfleet/" + path.split(f"{os.sep}rlfleet{os.sep}", 1)[1].replace(os.sep, "/")


def _listed() -> list[str]:
    """The files ARCHITECTURE.md lists for one step (lines ``1. `rlfleet/...` ``)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## One GRPO step", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\s*\d+\.\s+`(rlfleet/[^`]+\.py)`", section, flags=re.MULTILINE)


def test_one_grpo_step_passes_through_at_most_52_files(tmp_path: Path) -> None:
    touched = _files_of_step(tmp_path)
    assert touched, "the profiler saw no step"
    assert len(touched) <= LIMIT, f"one step went through {len(touched)} files: {touched}"
    listed = _listed()
    assert len(listed) <= LIMIT and len(set(listed)) == len(listed)
    missing = sorted(set(touched) - set(listed))
    assert missing == [], f"ARCHITECTURE.md does not list {missing}"
