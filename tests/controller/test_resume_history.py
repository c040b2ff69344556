"""A run resumed from a checkpoint continues its history (issue 35, point 3): metrics.jsonl and
TensorBoard keep the steps up to the checkpoint's and drop the stopped run's later ones, and the
console says where the run resumed. Real files, the real TensorBoard event reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.controller.loggers import RunMetrics
from rlfleet.controller.run import resumed_line

pytestmark = pytest.mark.timeout(60)


def _tensorboard(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _run(run_dir: Path, steps: range, from_step: int = 0, scale: float = 1.0) -> None:
    metrics = RunMetrics(["jsonl", "tensorboard"], run_dir, {}, log_every=1)
    metrics.begin(total_steps=8, num_epochs=1, from_step=from_step)
    for step in steps:
        metrics.log(step, 1, {"loss": step * scale})
    metrics.close()


def test_a_resumed_run_continues_jsonl_and_tensorboard_past_its_checkpoint(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 6))  # stopped after step 5; its latest checkpoint is step 3
    _run(tmp_path, range(4, 8), from_step=3, scale=10.0)  # resume_from checkpoint-3: steps 4.. again
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0), (7, 70.0)]
    assert [(r["step"], r["loss"]) for r in rows] == expected
    assert _tensorboard(tmp_path, "loss") == expected


def test_a_fresh_run_in_the_same_folder_starts_both_histories_over(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 4))
    _run(tmp_path, range(1, 3), scale=100.0)  # not resumed: a new run
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 100.0), (2, 200.0)]


def test_the_resume_line_names_the_checkpoint_and_the_kept_steps(tmp_path: Path) -> None:
    line = resumed_line(tmp_path / "checkpoint-10", 10)
    assert line.startswith("resumed from checkpoint-10 (step 10; metrics keep steps 1-10;"), line
    assert "\n" not in line
