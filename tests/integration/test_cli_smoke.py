"""The ``rlfleet`` console script as a user runs it: help, resolved config, bad input.

A full ``rlfleet train`` run is in test_tiny_grpo_run.py, its failures in test_failures.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"


def _run(venv_script, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([venv_script("rlfleet"), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


@pytest.mark.timeout(60)
def test_help_lists_the_commands_without_importing_torch(venv_script, cli_env) -> None:
    shown = _run(venv_script, cli_env, "--help")
    assert shown.returncode == 0 and "train" in shown.stdout and "config" in shown.stdout
    probe = "import sys, rlfleet.controller.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0


@pytest.mark.timeout(60)
def test_config_command_applies_overrides(venv_script, cli_env) -> None:
    overrides = ["rollout.engine.type=hf", "max_steps=2", "update.kl_coef=0.1"]
    shown = _run(venv_script, cli_env, "config", str(EXAMPLE), *overrides)
    assert shown.returncode == 0, shown.stderr
    job = json.loads(shown.stdout)
    assert (job["rollout"]["engine"], job["max_steps"], job["update"]["kl_coef"]) == ({"type": "hf"}, 2, 0.1)


@pytest.mark.timeout(60)
def test_bad_input_exits_2_with_a_one_line_reason(venv_script, cli_env, tmp_path: Path) -> None:
    typo = _run(venv_script, cli_env, "train", str(EXAMPLE), "learning_rat=0.1")
    assert typo.returncode == 2 and "did you mean 'learning_rate'" in typo.stderr  # a short form as it is
    flat = _run(venv_script, cli_env, "train", str(EXAMPLE), "eval_dat=held.jsonl")
    assert flat.returncode == 2 and "did you mean 'eval.data'" in flat.stderr  # a flat key by its new place
    missing = _run(venv_script, cli_env, "train", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "no such config file" in missing.stderr


@pytest.mark.timeout(120)
def test_a_missing_checkpoint_exits_2_before_anything_starts(venv_script, cli_env, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = _run(venv_script, cli_env, "train", str(EXAMPLE), f"output_dir={out}", "resume_from=/nonexistent")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().startswith("rlfleet: cannot resume from '/nonexistent'"), run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (out / "fleet").exists(), "nothing may be spawned for a missing checkpoint"
