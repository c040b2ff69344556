"""The run's fixed trainer settings reach the trainer before the first step (``TrainerConfigure``), and a
trainer that holds the model otherwise refuses the run: a one-line user error naming the worker and
each conflicting field. A fake trainer on the in-process transport answers as a real one would."""

from __future__ import annotations

import pytest

from rlfleet.common.control.inproc_transport import InProcessBroker, InProcessTransport
from rlfleet.common.control.messages import AnyMessage, TrainerConfigure, TrainerConfigured, WorkerAnnounce
from rlfleet.common.control.transport import membership_subject, subject
from rlfleet.common.errors import UserError
from rlfleet.common.schema.trainer import ModelSettings
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.errors import SettingsConflict
from rlfleet.controller.fleet import Fleet

CLUSTER = "unit"


class Refused(UserError, ValueError):
    """What a trainer raises for a run it cannot join (the wire code says whose mistake it is)."""

    code = "settings_conflict"


class FakeTrainer:
    """Holds ``model`` settings; accepts a run with the same, refuses one that differs, field by field."""

    def __init__(self, broker: InProcessBroker, model: ModelSettings) -> None:
        self.transport = InProcessTransport(broker, tier="trainer", name="trainer-7")
        self.model = model
        self.seen: list[TrainerConfigure] = []

    async def start(self) -> None:
        await self.transport.subscribe(subject(CLUSTER, "trainer", "configure"), self._on_configure)
        await self.transport.publish(
            membership_subject(CLUSTER, "trainer"), WorkerAnnounce(tier="trainer", worker_id="trainer-7")
        )

    async def _on_configure(self, message: AnyMessage) -> AnyMessage:
        assert isinstance(message, TrainerConfigure)
        self.seen.append(message)
        conflicts = message.model.conflicts(self.model)
        if conflicts:
            raise Refused(
                "; ".join(f"{k}: run {run!r}, worker {mine!r}" for k, (run, mine) in conflicts.items())
            )
        return TrainerConfigured(worker_id="trainer-7", weight_version=0)


async def _configure(run: TrainerConfig, held: ModelSettings) -> FakeTrainer:
    broker = InProcessBroker()
    trainer = FakeTrainer(broker, held)
    fleet = Fleet(InProcessTransport(broker, name="controller"), CLUSTER, request_timeout=10.0)
    await fleet.start()
    await trainer.start()
    await fleet.wait_ready({"trainer": 1}, timeout=5)
    message = TrainerConfigure(model=run.model, device=run.placement.device, critic=False)
    try:
        await fleet.configure_trainer(message)
    finally:
        await fleet.close()
    return trainer


@pytest.mark.timeout(20)
async def test_the_run_s_model_settings_reach_the_trainer() -> None:
    run = TrainerConfig(model={"sharding": "full", "trainable_layers": 2})
    trainer = await _configure(run, ModelSettings(sharding="full", trainable_layers=2))
    (sent,) = trainer.seen
    assert sent.model == ModelSettings(sharding="full", trainable_layers=2) and sent.device == "auto"


@pytest.mark.timeout(20)
async def test_a_conflict_names_the_worker_and_each_field_in_one_line() -> None:
    run = TrainerConfig(model={"sharding": "full", "param_dtype": "bfloat16"})
    with pytest.raises(SettingsConflict) as caught:
        await _configure(run, ModelSettings(sharding="none"))
    error = caught.value
    assert isinstance(error, UserError) and error.worker == "trainer-7"
    message = str(error)
    assert "\n" not in message and message.startswith("trainer worker trainer-7 refuses this run's settings")
    assert "sharding: run 'full', worker 'none'" in message and "param_dtype" in message
