"""GRPOTrainer's step loop against an in-memory fleet: what each step asks of the tiers (the step
settings included), and how a dying process or a failed step ends the run (no NATS, no workers)."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.schema.trainer import StepSettings
from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig
from rlfleet.controller.errors import TierDied
from rlfleet.controller.models import resolve_model

DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_digits.jsonl"


class FakeLauncher:
    """Reports a dead trainer process from the ``die_after``-th check on; records stop()."""

    def __init__(self, die_after: int | None = None) -> None:
        self.die_after = die_after
        self.checks = 0
        self.stopped = False
        self.pids: list[int] = []

    def check(self) -> None:
        self.checks += 1
        if self.die_after is not None and self.checks > self.die_after:
            raise TierDied("trainer", "trainer-0", -9)

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("tiny:digits", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture
def make_trainer(model_dir: Path, tmp_path: Path, attach_fleet: Any) -> Any:
    """``make_trainer(fleet)``: a GRPOTrainer of 4 prompts x 2 samples a step over ``fleet``."""

    def make(fleet: Any) -> GRPOTrainer:
        config = TrainerConfig(rollout_batch_size=4, train_batch_size=4, group_size=2, kl_coef=0.05,
                               output_dir=str(tmp_path), loggers=["jsonl"], sample_table_size=0)  # fmt: skip
        dataset = PromptDataset(str(DATA), 32)
        trainer = GRPOTrainer(str(model_dir), "charset:allowed=0123456789", dataset, config)
        attach_fleet(trainer, fleet)
        return trainer

    return make


def test_kl_coef_set_between_steps_reaches_the_next_train_step(
    make_trainer: Any, tmp_path: Path, fake_fleet
) -> None:
    fleet = fake_fleet()
    trainer = make_trainer(fleet)
    results = []
    for result in trainer.steps(num_epochs=1, max_steps=3):
        results.append(result)
        if result.step == 1:
            trainer.kl_coef = 0.25
    trainer.close()
    assert [r.settings.update.kl_coef for r in fleet.train_requests] == [0.05, 0.25, 0.25]
    assert [r.metrics["kl_coef"] for r in results] == [0.05, 0.25, 0.25]
    assert [r.step for r in fleet.train_requests] == [1, 2, 3] and trainer.global_step == 3
    assert {len(r.scores) for r in fleet.train_requests} == {4 * 2}
    sent = fleet.train_requests[0].settings  # the run's step settings travel with every step
    batch = sent.batch
    assert (sent.algorithm.name, batch.group_size, batch.num_updates, sent.update.learning_rate) == (
        "grpo", 2, 1, 1e-6,
    )  # fmt: skip
    assert sent == StepSettings.of(trainer.config, kl_coef=0.05)  # response_cap only with overlong shaping
    assert [(r.weight_version, r.metrics["rollout/weight_version_min"]) for r in results] == [
        (1, 1),
        (2, 2),
        (3, 3),
    ]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert fleet.published_with == [("auto", "")] * 3  # float32 engines: published as the trainer holds them


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf])
def test_kl_coef_rejects_values_a_loss_cannot_use(make_trainer: Any, bad: float, fake_fleet) -> None:
    trainer = make_trainer(fake_fleet())
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0"):
        trainer.kl_coef = bad
    assert trainer.kl_coef == 0.05
    trainer.close()


def test_a_failed_step_stops_the_fleet(make_trainer: Any, fake_fleet) -> None:
    trainer = make_trainer(fake_fleet(fail_train_at=2))
    launcher = FakeLauncher()
    trainer.fleet_run.launcher = launcher  # type: ignore[assignment]
    steps = trainer.steps(num_epochs=1, max_steps=5)
    assert next(steps).step == 1 and not launcher.stopped
    with pytest.raises(TierDied, match="out of memory"):
        next(steps)
    assert launcher.stopped and trainer.process_ids == []


def test_a_dead_process_ends_a_wait_at_once(make_trainer: Any, fake_fleet) -> None:
    trainer = make_trainer(fake_fleet())
    trainer.fleet_run.launcher = FakeLauncher(die_after=2)  # type: ignore[assignment]
    t0 = time.monotonic()
    with pytest.raises(TierDied, match="trainer worker trainer-0 was killed by signal SIGKILL"):
        trainer.run(asyncio.sleep(30))
    assert time.monotonic() - t0 < 5
    trainer.close()


def test_a_request_failing_because_its_worker_died_reports_the_death(make_trainer: Any, fake_fleet) -> None:
    trainer = make_trainer(fake_fleet())
    trainer.fleet_run.launcher = FakeLauncher(die_after=2)  # type: ignore[assignment]

    async def lost_connection() -> None:
        raise ConnectionError("connection reset by peer")

    with pytest.raises(TierDied) as caught:
        trainer.run(lost_connection())
    assert isinstance(caught.value.__cause__, ConnectionError)
    trainer.fleet_run.launcher = FakeLauncher()  # type: ignore[assignment]
    with pytest.raises(ConnectionError):  # no process died: the request's own error stands
        trainer.run(lost_connection())
    trainer.close()


def test_close_stops_the_processes_even_when_leaving_the_control_plane_fails(
    make_trainer: Any, fake_fleet
) -> None:
    trainer = make_trainer(fake_fleet())
    launcher = FakeLauncher()
    trainer.fleet_run.launcher = launcher  # type: ignore[assignment]
    trainer.run(asyncio.sleep(0))  # the loop exists

    class BrokenTransport:
        async def close(self) -> None:
            raise ValueError("unexpected")

    trainer.fleet_run.transport = BrokenTransport()
    with pytest.raises(ValueError, match="unexpected"):
        trainer.close()
    assert launcher.stopped
