"""A run that goes back logs each step once (issue 12, point 5).

A trainer restored from ``checkpoint-4`` after step 5 runs step 5 again: ``metrics.jsonl`` ends with
steps 1..6 once each, the replay's values; TensorBoard shows each step once (the replay's, through
``purge_step``); :meth:`RunMetrics.rewind` drops later steps ahead of the replay. Real files, real
TensorBoard event reader.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.controller.loggers import JsonlSink, RunMetrics, TensorBoardSink

pytestmark = pytest.mark.timeout(60)


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_replayed_step_replaces_its_line_and_the_later_ones(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path)
    for step in (1, 2, 3, 4, 5):
        sink.log(step, {"loss": float(step)})
    sink.log(5, {"loss": 50.0})  # restored from checkpoint-4: step 5 again
    sink.log(6, {"loss": 60.0})
    sink.log(3, {"loss": 30.0})  # further back: 4..6 are gone with it
    sink.close()
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert not list(tmp_path.glob(".*.tmp")), "rewritten atomically, nothing left behind"


def test_rewind_ahead_of_the_replay_and_appending_after_it(tmp_path: Path) -> None:
    metrics = RunMetrics(["jsonl"], tmp_path, {}, log_every=1)
    metrics.begin(total_steps=6, num_epochs=1)
    for step in (1, 2, 3, 4, 5):
        metrics.log(step, 1, {"loss": float(step)})
    metrics.rewind(4)  # what the supervision does when it restores checkpoint-4
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    metrics.rewind(4)  # nothing more to drop
    metrics.log(5, 1, {"loss": 55.0})
    metrics.log(6, 1, {"loss": 66.0})
    metrics.close()
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[4]["loss"] == 55.0 and rows[5]["loss"] == 66.0


def test_a_line_that_is_not_a_step_is_dropped_by_a_rewind(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path)
    sink.log(1, {"loss": 1.0})
    sink.log(2, {"loss": 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as file:
        file.write("not json\n")  # a torn line of some earlier writer
    sink.log(2, {"loss": 22.0})
    sink.close()
    assert [(r["step"], r["loss"]) for r in _rows(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 22.0)]


def test_tensorboard_shows_a_replayed_step_once_with_the_replay_value(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    for step in (1, 2, 3, 4, 5):
        sink.log(step, {"loss": float(step)})
    sink.log(5, {"loss": 50.0})
    sink.log(6, {"loss": 60.0})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("loss")]
    assert scalars == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0)], scalars


def test_a_resumed_run_keeps_the_steps_before_its_checkpoint(tmp_path: Path) -> None:
    """``resume_from`` checkpoint-2 in the same folder: steps 1 and 2 stay, the later lines of the
    stopped run go (they are run again), and the resumed steps follow; a new run replaces the file."""
    first = RunMetrics(["jsonl"], tmp_path, {}, log_every=1)
    first.begin(total_steps=6, num_epochs=1)
    for step in (1, 2, 3):
        first.log(step, 1, {"loss": float(step)})
    first.close()
    resumed = RunMetrics(["jsonl"], tmp_path, {}, log_every=1)
    resumed.begin(total_steps=6, num_epochs=1, from_step=2)
    resumed.log(3, 1, {"loss": 33.0})
    resumed.log(4, 1, {"loss": 44.0})
    resumed.close()
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 33.0), (4, 44.0)]
    fresh = RunMetrics(["jsonl"], tmp_path, {}, log_every=1)
    fresh.begin(total_steps=6, num_epochs=1)
    fresh.log(1, 1, {"loss": 9.0})
    fresh.close()
    assert [(r["step"], r["loss"]) for r in _rows(tmp_path / "metrics.jsonl")] == [(1, 9.0)]
