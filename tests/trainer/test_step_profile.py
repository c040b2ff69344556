"""A train step under the profiler on request: the steps asked for write their operator table, the
others and a run without the variable write nothing, a malformed step list is named, not fatal."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rlfleet.common.schema.trainer import StepSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.service import run_step
from rlfleet.trainer.step_profile import DIR_ENV, STEPS_ENV, maybe_profiled, profile_target, profiled_steps

pytestmark = pytest.mark.timeout(60)

MakeBatch = Callable[..., dict[str, torch.Tensor]]


def test_the_step_list_parses_and_a_bad_entry_is_named() -> None:
    assert profiled_steps(None) == {2, 3}
    assert profiled_steps(" ") == {2, 3}
    assert profiled_steps("1, 5") == {1, 5}
    for bad in ("2,x", "0", "-1", "2,,3"):
        with pytest.raises(ValueError, match=STEPS_ENV):
            profiled_steps(bad)


def test_nothing_is_profiled_without_the_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DIR_ENV, raising=False)
    assert profile_target(2, 0) is None


def test_a_bad_step_list_profiles_nothing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    monkeypatch.setenv(STEPS_ENV, "two")
    with caplog.at_level(logging.WARNING):
        assert profile_target(2, 0) is None
    assert "'two' is not a step number" in caplog.text


def test_a_profiled_step_writes_its_operator_table(
    tiny_model_dir: Path, make_batch: MakeBatch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "profiles"
    monkeypatch.setenv(DIR_ENV, str(folder))
    monkeypatch.setenv(STEPS_ENV, "4")
    actor = Actor(tiny_model_dir, seed=0, learning_rate=1e-2)
    settings = StepSettings(micro_batch_size=2)
    for step in (3, 4):
        with maybe_profiled(step, 0, actor.device):
            metrics = run_step(actor, None, make_batch([3, 5], [4, 2]), [1.0, 0.0], settings)
        assert metrics["time/plan_s"] <= metrics["time/update_s"]
    written = sorted(p.name for p in folder.iterdir())
    assert written == ["trainer-step-4-rank0.trace.json", "trainer-step-4-rank0.txt"]  # not step 3
    text = (folder / written[1]).read_text()
    assert json.loads((folder / written[0]).read_text())["traceEvents"]  # the timeline
    assert "trainer step 4, rank 0, cpu" in text
    assert "aten::mm" in text or "aten::addmm" in text or "aten::linear" in text  # the model's matmuls
