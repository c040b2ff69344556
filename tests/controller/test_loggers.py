"""Metric sinks and the console's ``[PROGRESS]`` line."""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path

import pytest

from rlfleet.controller.errors import LoggerUnavailable
from rlfleet.controller.loggers import (
    ConsoleProgress,
    JsonlSink,
    TensorBoardSink,
    check_loggers,
    make_sinks,
    progress_line,
)

PROGRESS = re.compile(
    r"^\[PROGRESS\] Epoch \d+/\d+ \| Step \d+/\d+ \| Loss: \S+ \| Reward: \S+ \| KL: \S+( \| .+)?$"
)
METRICS = {"loss": 2.14, "reward/mean": 4.21, "kl": 0.087, "response_length": 11.46}


def test_progress_line_reads_as_specified() -> None:
    line = progress_line(1, 3, 100, 1200, METRICS)
    assert line.startswith("[PROGRESS] Epoch 1/3 | Step 100/1200 | Loss: 2.14 | Reward: 4.21 | KL: 0.087")
    assert line == "[PROGRESS] Epoch 1/3 | Step 100/1200 | Loss: 2.14 | Reward: 4.21 | KL: 0.087 | Len: 11.5"
    assert PROGRESS.match(line)


def test_progress_line_without_kl_says_not_available() -> None:
    metrics = {k: v for k, v in METRICS.items() if k != "kl"}
    line = progress_line(2, 3, 7, 36, metrics)
    assert "| KL: n/a |" in line and PROGRESS.match(line)


@pytest.mark.parametrize(("value", "shown"), [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_progress_line_shows_a_non_finite_metric(value: float, shown: str) -> None:
    line = progress_line(2, 3, 7, 36, {**METRICS, "loss": value})
    assert f"| Loss: {shown} |" in line and PROGRESS.match(line)


def test_console_progress_prints_every_log_every_and_the_last_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    progress = ConsoleProgress(total_steps=5, num_epochs=1, log_every=2)
    for step in range(1, 6):
        progress.update(step, 1, METRICS)
    progress.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[PROGRESS]")]
    assert [line.split("| Step ")[1].split(" ")[0] for line in lines] == ["2/5", "4/5", "5/5"]


def test_jsonl_sink_writes_one_row_per_step_and_names_non_finite_values(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 99}\n')  # a previous run's file is replaced
    sink = JsonlSink(tmp_path)
    before = time.time()
    sink.log(1, {"loss": 0.5, "kl": math.nan})
    sink.log(2, {"loss": 0.25, "kl": math.inf, "grad_norm": -math.inf})
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    stamps = [row.pop("time") for row in rows]  # when each step ended (the step-files test reads it)
    assert rows == [{"step": 1, "loss": 0.5, "kl": "NaN"},
                    {"step": 2, "loss": 0.25, "kl": "Infinity", "grad_norm": "-Infinity"}]  # fmt: skip
    assert before - 0.001 <= stamps[0] <= stamps[1] <= time.time() + 0.001


def test_tensorboard_sink_writes_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    for step in (1, 2, 3):
        sink.log(step, {"reward/mean": step / 10, "kl": math.nan if step == 2 else 0.5})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]
    kl = [e.value for e in events.Scalars("kl")]  # a non-finite value is shown, not dropped
    assert kl[0] == kl[2] == 0.5 and math.isnan(kl[1])


def test_selecting_wandb_without_the_package_fails_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(
        LoggerUnavailable, match="'wandb' is selected but the 'wandb' package is not installed"
    ) as info:
        check_loggers(["console", "wandb"])
    assert "pip install 'rlfleet-controller[wandb]'" in str(info.value)  # the extra that brings it
    with pytest.raises(LoggerUnavailable):
        make_sinks(["wandb"], tmp_path, {})
    check_loggers(["console", "jsonl", "tensorboard"])


@pytest.mark.timeout(120)
def test_wandb_sink_logs_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "rlfleet-tests")
    check_loggers(["wandb"])
    try:
        (sink,) = make_sinks(["wandb"], tmp_path, {"learning_rate": 0.003})
        sink.log(1, {"reward/mean": 0.1})
        sink.log(2, {"reward/mean": 0.4})
        sink.close()
    finally:
        wandb.teardown()  # stops the wandb-core helper process the run started
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run_dir.glob("*.wandb")), f"no run file in {sorted(p.name for p in run_dir.iterdir())}"


def test_a_step_with_non_finite_metrics_is_named_on_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlfleet.controller.loggers import RunMetrics, nonfinite_line

    assert nonfinite_line(3, METRICS) is None
    run = RunMetrics(["jsonl"], tmp_path, {}, log_every=1)
    run.begin(total_steps=2, num_epochs=1)
    run.log(1, 1, {**METRICS, "grad_norm": math.inf, "update_skipped": 1.0})
    run.log(2, 1, {**METRICS, "kl": math.nan, "update_skipped": 0.0})
    run.close()
    out = capsys.readouterr().out
    skipped = "the trainer skipped the update (update_skipped=1)"
    assert f"[WARNING] Step 1: not finite: grad_norm=inf; {skipped}" in out
    assert "[WARNING] Step 2: not finite: kl=nan; the update was applied" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["grad_norm"] == "Infinity" and rows[1]["kl"] == "NaN"
