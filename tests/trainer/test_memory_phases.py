"""Peak memory per phase of a train step: the keys and values a phase records (on a fake device),
each phase's peak starting again from what is held, and a CPU step that reports none."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rlfleet.common.schema.trainer import StepSettings, UpdateSettings
from rlfleet.trainer import service
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.memory_phases import GIB, PhasePeaks, peak_key
from rlfleet.trainer.service import run_step

pytestmark = pytest.mark.timeout(60)

MakeBatch = Callable[..., dict[str, torch.Tensor]]
SLACK = GIB // 2  # the fake allocator reserves half a GiB more than it allocates


class FakeDevice:
    """A device's counters: what tensors hold now, and the peak since the last reset."""

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0
        self.resets = 0

    def allocate(self, nbytes: float) -> None:
        self.held += int(nbytes)
        self.peak = max(self.peak, self.held)

    def free(self, nbytes: float) -> None:
        self.held -= int(nbytes)

    def reset_peak(self) -> None:
        self.peak = self.held
        self.resets += 1

    def peak_bytes(self) -> tuple[int, int]:
        return self.peak, self.peak + int(SLACK)


def test_each_phase_reports_its_own_peak_from_what_is_held() -> None:
    device = FakeDevice()
    device.allocate(GIB)  # the weights, held through every phase
    peaks = PhasePeaks(device)
    with peaks.phase("plan"):
        device.allocate(3 * GIB)  # logprobs of a large micro-batch
        device.free(3 * GIB)
    with peaks.phase("update"):
        device.allocate(2 * GIB)  # activations and gradients
        device.free(GIB)
    assert device.resets == 2
    assert peaks.metrics == {
        "memory/plan_peak_allocated_gib": 4.0, "memory/plan_peak_reserved_gib": 4.5,
        "memory/update_peak_allocated_gib": 3.0, "memory/update_peak_reserved_gib": 3.5,
    }  # fmt: skip
    step = peaks.step_metrics()
    assert step[peak_key("step", "allocated")] == 4.0 and step[peak_key("step", "reserved")] == 4.5
    assert {k: v for k, v in step.items() if "/step_" not in k} == peaks.metrics


def test_a_phase_that_raises_records_nothing() -> None:
    peaks = PhasePeaks(FakeDevice())
    with pytest.raises(RuntimeError), peaks.phase("update"):
        raise RuntimeError("out of memory")
    assert peaks.metrics == {} and peaks.step_metrics() == {}


def _settings() -> StepSettings:
    return StepSettings(
        algorithm="grpo", update=UpdateSettings(learning_rate=1e-2, micro_batch_size=2, kl_coef=0.0)
    )


def test_a_cpu_step_reports_no_memory(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    actor = Actor(tiny_model_dir, seed=0, learning_rate=1e-2)
    assert service.memory_peaks(actor.device) is None
    metrics = run_step(actor, None, make_batch([3, 5], [4, 2]), [1.0, 0.0], _settings())
    assert "loss" in metrics and [key for key in metrics if key.startswith("memory/")] == []


def test_a_step_measures_its_plan_and_its_update(
    tiny_model_dir: Path, make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = FakeDevice()
    device.allocate(GIB)
    monkeypatch.setattr(service, "memory_peaks", lambda _: PhasePeaks(device))
    actor = Actor(tiny_model_dir, seed=0, learning_rate=1e-2)
    metrics = run_step(actor, None, make_batch([3, 5], [4, 2]), [1.0, 0.0], _settings())
    assert device.resets == 2  # once as the plan starts, once as the update starts
    memory = {key: value for key, value in metrics.items() if key.startswith("memory/")}
    phases, kinds = ("plan", "update", "step"), ("allocated", "reserved")
    expected = {peak_key(p, k): 1.0 if k == "allocated" else 1.5 for p in phases for k in kinds}
    assert memory == expected  # nothing allocated beyond the weights: every peak is what is held
