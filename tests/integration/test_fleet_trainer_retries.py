"""The controller's trainer requests (``Fleet``) on a real nats-server and a real trainer worker:
a step sent while no trainer is up yet is retried within the budget (one job id, one update); a
trainer process other than the one the run configured is refused as ``TrainerRestarted``."""

# ruff: noqa: F811  (test_worker's `trainer` fixture, imported, is every test's argument)

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_worker import SCORES, Trainer, _rollouts, trainer  # noqa: F401  (the fixture; tests/trainer)

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import TrainerConfigure
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.schema.trainer import ModelSettings, StepSettings, UpdateSettings
from rlfleet.controller.errors import RetriesExhausted, TrainerRestarted
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.fleet import Fleet
from rlfleet.trainer.service import TrainerWorker

pytestmark = pytest.mark.timeout(120)

SETTINGS = StepSettings(update=UpdateSettings(learning_rate=1e-2, micro_batch_size=2, kl_coef=0.0))
CONFIGURE = TrainerConfigure(model=ModelSettings(sharding="full", mixed_precision="none"), device="cpu",
                             critic=False)  # fmt: skip
FAST = FaultSettings(retry_attempts=8, retry_backoff_s=0.1, retry_backoff_max_s=0.4)


@pytest.fixture(scope="session")
def tiny_model_dir(trainer_model_dir: Path) -> Path:
    """The trainer suite's tiny Llama: test_worker's ``trainer`` fixture asks for it by this name."""
    return trainer_model_dir


def _fleet(trainer: Trainer, faults: FaultSettings = FAST) -> Fleet:
    return Fleet(trainer.client, trainer.worker.config.fleet.cluster, request_timeout=30, faults=faults)


async def test_a_step_sent_before_the_trainer_is_up_is_retried_as_one_job(
    trainer: Trainer, make_batch: Callable[..., dict[str, torch.Tensor]], nats_server: EmbeddedNats
) -> None:
    ref = trainer.put(_rollouts(make_batch))
    await trainer.worker.stop("the trainer is down for a moment")
    fleet = _fleet(trainer)
    step = asyncio.ensure_future(fleet.train_step(1, [ref], SCORES, SETTINGS))
    await asyncio.sleep(0.5)  # tries fail on NoResponders meanwhile
    assert not step.done()
    server = await NatsTransport.connect(nats_server.url, name="trainer-again", tier="trainer")
    back = TrainerWorker(trainer.worker.config, server)
    await back.start()
    try:
        result = await asyncio.wait_for(step, 60)
        assert result.step == 1 and result.incarnation == back.incarnation
    finally:
        await back.stop("test over")
        await server.close()


async def test_no_trainer_within_the_budget_is_a_named_failure(
    trainer: Trainer, make_batch: Callable[..., dict[str, torch.Tensor]]
) -> None:
    ref = trainer.put(_rollouts(make_batch))
    await trainer.worker.stop("gone for good")
    fleet = _fleet(trainer, FaultSettings(retry_attempts=3, retry_backoff_s=0.05, retry_backoff_max_s=0.1))
    with pytest.raises(RetriesExhausted) as info:
        await fleet.train_step(4, [ref], SCORES, SETTINGS)
    assert info.value.attempts == 3 and "train step 4" in str(info.value)


async def test_a_restarted_trainer_is_refused_not_adopted(
    trainer: Trainer, make_batch: Callable[..., dict[str, torch.Tensor]], nats_server: EmbeddedNats
) -> None:
    fleet = _fleet(trainer)
    configured = await fleet.configure_trainer(CONFIGURE)
    assert fleet.trainer_incarnation == configured.incarnation == trainer.worker.incarnation
    ref = trainer.put(_rollouts(make_batch))
    first = await fleet.train_step(1, [ref], SCORES, SETTINGS)
    assert first.incarnation == configured.incarnation
    await trainer.worker.stop("crash")
    server = await NatsTransport.connect(nats_server.url, name="trainer-new", tier="trainer")
    restarted = TrainerWorker(trainer.worker.config, server)  # base weights, a new incarnation
    await restarted.start()
    try:
        with pytest.raises(TrainerRestarted) as info:
            await fleet.train_step(2, [trainer.put(_rollouts(make_batch))], SCORES, SETTINGS)
        assert info.value.configured == configured.incarnation and info.value.now == restarted.incarnation
        assert "save_every" in str(info.value)
        with pytest.raises(TrainerRestarted):
            await fleet.publish_weights(0.05)
        again = await fleet.configure_trainer(CONFIGURE)  # the run restores it, then adopts it
        assert fleet.trainer_incarnation == again.incarnation == restarted.incarnation
    finally:
        await restarted.stop("test over")
        await server.close()
