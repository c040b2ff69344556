"""The trainer worker on a real nats-server (one process, CPU): ``trainer.configure`` accepts the run's
fixed settings or refuses them naming each field, and every ``trainer.step`` trains with the settings
it carries."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import (
    Ping,
    PublishWeights,
    TrainerConfigure,
    TrainerConfigured,
    TrainStepRequest,
    TrainStepResult,
)
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject
from rlfleet.common.errors import RemoteUserError
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.trainer import (
    ModelSettings,
    StepSettings,
    TrainerWorkerConfig,
    UpdateSettings,
    model_fingerprint,
)
from rlfleet.common.schema.worker import FleetAddress, Placement
from rlfleet.common.tensors.store import TensorStoreServer
from rlfleet.trainer import service
from rlfleet.trainer.memory_phases import GIB, PhasePeaks
from rlfleet.trainer.service import TrainerWorker

pytestmark = pytest.mark.timeout(120)

PROMPTS, RESPONSES = [3, 5, 2, 4], [4, 2, 6, 3]
SCORES = [1.0, 0.0, 0.2, 0.6]


class Trainer:
    """A started TrainerWorker, a client on the same nats-server, and a store holding rollouts."""

    def __init__(self, client: NatsTransport, worker: TrainerWorker, store: TensorStoreServer) -> None:
        self.client, self.worker, self.store = client, worker, store

    async def ask(self, verb: str, message: Any) -> Any:
        target = subject(self.worker.config.fleet.cluster, "trainer", verb)
        return await self.client.request(target, message, timeout=60)

    def put(self, batch: dict[str, torch.Tensor]) -> TensorRef:
        return self.store.put_local(f"rollouts/{uuid.uuid4().hex[:8]}", batch)


@pytest.fixture
async def trainer(nats_server: EmbeddedNats, tiny_model_dir: Path) -> AsyncIterator[Trainer]:
    config = TrainerWorkerConfig(
        model_path=str(tiny_model_dir), worker_id="trainer-0", weights_store_mb=64,
        fleet=FleetAddress(nats_url=nats_server.url, cluster=f"t{uuid.uuid4().hex[:8]}"),
        placement=Placement(device="cpu"), model=ModelSettings(sharding="full"),
        step=StepSettings(update=UpdateSettings(learning_rate=1e-3, micro_batch_size=2, kl_coef=0.0)),
    )  # fmt: skip
    server = await NatsTransport.connect(nats_server.url, name="trainer", tier="trainer")
    client = await NatsTransport.connect(nats_server.url, name="test", tier="controller")
    store = TensorStoreServer(capacity_bytes=1 << 24, ttl_s=600)
    await store.start()
    worker = TrainerWorker(config, server)
    await worker.start()
    try:
        yield Trainer(client, worker, store)
    finally:
        await worker.stop("test over")
        await store.stop()
        await client.close()
        await server.close()


def _rollouts(make_batch: Callable[..., dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = make_batch(PROMPTS, RESPONSES)
    batch["rollout_logprobs"] = torch.zeros(batch["response_ids"].shape, dtype=torch.float32)
    return batch


async def test_configure_accepts_the_workers_own_settings(trainer: Trainer, tiny_model_dir: Path) -> None:
    request = TrainerConfigure(
        model=ModelSettings(sharding="full", mixed_precision="none"),  # "none" is what "auto" is on a CPU
        device="auto", critic=False, model_fingerprint=model_fingerprint(tiny_model_dir),
    )  # fmt: skip
    reply = await trainer.ask("configure", request)
    assert isinstance(reply, TrainerConfigured) and reply.worker_id == "trainer-0"
    assert reply.weight_version == trainer.worker.weight_version


async def test_configure_refuses_other_settings_naming_each_field(
    trainer: Trainer, tiny_model_dir: Path
) -> None:
    request = TrainerConfigure(
        model=ModelSettings(sharding="none", trainable_layers=1, param_dtype="bfloat16"), device="cuda",
        critic=True, model_fingerprint="ab12cd34ab12cd34",
    )  # fmt: skip
    with pytest.raises(RemoteUserError) as refused:
        await trainer.ask("configure", request)
    assert refused.value.code == "settings_conflict" and not refused.value.retryable
    message = refused.value.remote_message
    fingerprint = model_fingerprint(tiny_model_dir)
    for part in (
        "trainer worker trainer-0 refuses this run's settings",
        "sharding: run 'none', worker 'full'",
        "trainable_layers: run 1, worker None",
        "param_dtype: run 'bfloat16', worker 'float32'",
        "device: run 'cuda', worker 'cpu'",
        f"model: run fingerprint ab12cd34ab12cd34, worker fingerprint {fingerprint}",
        "critic: run trains one, worker holds none",
    ):
        assert part in message, (part, message)
    assert "mixed_precision" not in message and "gradient_checkpointing" not in message
    request = TrainerConfigure(model=ModelSettings(sharding="full", mixed_precision="bf16"), device="cpu",
                               critic=False)  # fmt: skip
    with pytest.raises(RemoteUserError, match=r"mixed_precision: run 'bf16', worker 'auto' \(none on cpu\)$"):
        await trainer.ask("configure", request)


async def test_each_step_trains_with_the_settings_it_carries(
    trainer: Trainer, make_batch: Callable[..., dict[str, torch.Tensor]]
) -> None:
    ref = trainer.put(_rollouts(make_batch))
    first = StepSettings(
        update=UpdateSettings(learning_rate=2e-3, clip_eps=0.1, micro_batch_size=3, kl_coef=0.0)
    )
    result = await trainer.ask(
        "step", TrainStepRequest(step=1, rollouts=[ref], scores=SCORES, settings=first)
    )
    assert isinstance(result, TrainStepResult)
    assert result.metrics["lr"] == pytest.approx(2e-3)
    assert result.metrics["settings/clip_eps"] == pytest.approx(0.1)
    assert result.metrics["settings/micro_batch_size"] == 3
    second = StepSettings.of(first, learning_rate=5e-4, clip_eps=0.3, micro_batch_size=1)
    result = await trainer.ask(
        "step", TrainStepRequest(step=2, rollouts=[ref], scores=SCORES, settings=second)
    )
    assert result.metrics["lr"] == pytest.approx(5e-4)
    assert result.metrics["settings/clip_eps"] == pytest.approx(0.3)
    assert result.metrics["settings/micro_batch_size"] == 1
    assert trainer.worker.actor.scheduler.base_lrs == [5e-4]
    # a request that carries no settings (JSON without the field) takes the worker's own
    bare = TrainStepRequest.model_validate({"step": 3, "rollouts": [ref.model_dump()], "scores": SCORES})
    own = trainer.worker.step_settings(bare)
    assert (own.update.learning_rate, own.update.micro_batch_size) == (1e-3, 2)
    carried = TrainStepRequest(step=4, rollouts=[ref], scores=SCORES, settings=second)
    assert trainer.worker.step_settings(carried) == second


async def test_a_bad_step_is_refused_naming_what_is_wrong(
    trainer: Trainer, make_batch: Callable[..., dict[str, torch.Tensor]]
) -> None:
    batch = _rollouts(make_batch)
    del batch["group_index"]
    with pytest.raises(RemoteUserError, match="group_index") as refused:
        await trainer.ask("step", TrainStepRequest(step=1, rollouts=[trainer.put(batch)], scores=SCORES))
    assert refused.value.code == "bad_request"
    ref = trainer.put(_rollouts(make_batch))
    with pytest.raises(RemoteUserError, match="3 scores for 4 samples"):
        await trainer.ask("step", TrainStepRequest(step=1, rollouts=[ref], scores=SCORES[:3]))
    with pytest.raises(RemoteUserError, match="critic") as refused:
        ppo = StepSettings(algorithm="ppo")
        await trainer.ask("step", TrainStepRequest(step=1, rollouts=[ref], scores=SCORES, settings=ppo))
    assert refused.value.code == "settings_conflict"
    with pytest.raises(RemoteUserError, match="trainer.step takes TrainStepRequest messages") as refused:
        await trainer.ask("step", Ping())
    assert refused.value.code == "bad_request"
    ok = await trainer.ask("step", TrainStepRequest(step=2, rollouts=[ref], scores=SCORES))
    assert isinstance(ok, TrainStepResult)  # the worker serves on after refusing


class _FlatMemory:
    """A device whose peaks are always 2 GiB allocated, 3 GiB reserved."""

    def reset_peak(self) -> None:
        pass

    def peak_bytes(self) -> tuple[int, int]:
        return int(2 * GIB), int(3 * GIB)


async def test_a_publish_reports_its_peak_memory_with_the_next_step(
    trainer: Trainer, make_batch: Callable[..., dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "memory_peaks", lambda _: PhasePeaks(_FlatMemory()))
    ref = trainer.put(_rollouts(make_batch))
    first = await trainer.ask("step", TrainStepRequest(step=1, rollouts=[ref], scores=SCORES))
    assert "memory/publish_peak_allocated_gib" not in first.metrics  # no publish before it
    assert first.metrics["memory/update_peak_allocated_gib"] == 2.0
    await trainer.ask("publish", PublishWeights())
    second = await trainer.ask("step", TrainStepRequest(step=2, rollouts=[ref], scores=SCORES))
    assert second.metrics["memory/publish_peak_allocated_gib"] == 2.0
    assert second.metrics["memory/publish_peak_reserved_gib"] == 3.0
    third = await trainer.ask("step", TrainStepRequest(step=3, rollouts=[ref], scores=SCORES))
    assert "memory/publish_peak_allocated_gib" not in third.metrics  # reported once
