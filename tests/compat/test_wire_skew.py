"""Wire compatibility with real builds of other releases (issue 15 point 3).

The previous release (``previous.toml``, built by conftest.py) and this one train the tiny GRPO
example together in both directions, a MINOR wire skew: the previous tiers under this controller
(the embedded launcher runs them through ``RLFLEET_<TIER>_SCRIPT``), and this release's tiers under
the previous controller (its launcher finds them on PATH). A MAJOR skew (this tree with its MAJOR
version bumped) is refused at connect: this controller stops the run at once, naming the worker
and both versions, and the worker's own log names both versions too. What the previous controller
does on a MAJOR skew is recorded as it is: it logs the refused announce, naming both versions, and
gives up when its startup timeout runs out. Each controller trains its own release's tiny GRPO
example (the previous one reads the previous release's flat form; this one, the nested form); this
controller writes its workers' config files and the step settings in the flat form, which the
previous tiers read.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from rlfleet.common.control.messages import PROTOCOL

if TYPE_CHECKING:
    from conftest import Release  # type: ignore[import-not-found]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # this release's console scripts
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"
STEPS = 2
TIERS = ("rollout", "reward", "trainer")


def _train(
    rlfleet: str, out: Path, env: dict[str, str], *overrides: str, example: Path = EXAMPLE
) -> subprocess.CompletedProcess[str]:
    command = [rlfleet, "train", "--log-level", "INFO", str(example), f"max_steps={STEPS}",
               f"output_dir={out}", "log_every=1", "loggers=[console,jsonl]", "sample_table_size=0",
               *overrides]  # fmt: skip
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)


def _steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if "reward/mean" in row]


def _log(out: Path, worker_id: str) -> str:
    return (out / "fleet" / "workers" / f"{worker_id}.log").read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_previous_tiers_train_under_this_controller(
    previous_tiers: Release, previous: dict[str, Any], run_env: dict[str, str], tmp_path: Path
) -> None:
    scripts = {f"RLFLEET_{tier.upper()}_SCRIPT": previous_tiers.script(f"rlfleet-{tier}") for tier in TIERS}
    out = tmp_path / "run"
    run = _train(str(BIN / "rlfleet"), out, {**run_env, **scripts})
    assert run.returncode == 0, run.stderr[-3000:]
    assert _steps(out) == list(range(1, STEPS + 1))
    for tier in TIERS:  # each worker that joined is the previous build: no release announced, its wire
        wire = previous["protocol"]
        joined = f"{tier} worker {tier}-0 joined (pool default, release not announced, wire {wire})"
        assert joined in run.stderr, run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_this_releases_tiers_train_under_the_previous_controller(
    previous_controller: Release, previous_source: Path, run_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    example = previous_source / "examples" / "tiny_grpo.yaml"  # the job as the previous release wrote it
    run = _train(previous_controller.script("rlfleet"), out, run_env, example=example)  # the tiers on PATH
    assert run.returncode == 0, run.stderr[-3000:]
    assert _steps(out) == list(range(1, STEPS + 1))
    assert "rollout worker rollout-0 joined (pool default)\n" in run.stderr  # the previous controller's words
    for tier in TIERS:
        release = importlib.metadata.version(f"rlfleet-{tier}")
        assert "is up on cluster " in _log(out, f"{tier}-0")
        assert f"(rlfleet-{tier} {release}, wire {PROTOCOL})" in _log(out, f"{tier}-0")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_worker_of_another_major_version_is_refused_at_connect(
    next_major: Release, run_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    env = {**run_env, "RLFLEET_ROLLOUT_SCRIPT": next_major.script("rlfleet-rollout")}
    started = time.monotonic()
    run = _train(str(BIN / "rlfleet"), out, env, "startup_timeout_s=300")
    took = time.monotonic() - started
    assert run.returncode == 2, run.stderr[-3000:]
    said = run.stderr.strip().splitlines()[-1]
    assert said.startswith("rlfleet: rollout worker rollout-0 (rlfleet-rollout "), said
    assert f"speaks wire protocol {next_major.protocol}, but this process" in said, said
    assert f"speaks wire protocol {PROTOCOL}: MAJOR versions must match" in said, said
    assert took < 300, "refused at connect, not after the startup timeout"
    refused = f"wire protocol mismatch: this process speaks {next_major.protocol}, the message is {PROTOCOL}"
    assert refused in _log(out, "rollout-0"), "the worker's own log names both versions"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_previous_controller_on_a_major_skew(
    previous_controller: Release, next_major: Release, previous: dict[str, Any], previous_source: Path,
    run_env: dict[str, str], tmp_path: Path,
) -> None:  # fmt: skip
    """The previous release as it is: it refuses every message of the other MAJOR version (a
    warning naming both versions) and fails once its startup timeout runs out."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "rlfleet-rollout").symlink_to(next_major.script("rlfleet-rollout"))
    env = {**run_env, "PATH": f"{shim}:{run_env['PATH']}"}
    out = tmp_path / "run"
    example = previous_source / "examples" / "tiny_grpo.yaml"
    run = _train(previous_controller.script("rlfleet"), out, env, "startup_timeout_s=30", example=example)
    assert run.returncode == 1, run.stderr[-3000:]
    protocol = previous["protocol"]
    refused = f"wire protocol mismatch: this process speaks {protocol}, the message is {next_major.protocol}"
    assert refused in run.stderr, run.stderr[-3000:]
    assert "rollout-0" in run.stderr.strip().splitlines()[-1]  # the worker that never joined
