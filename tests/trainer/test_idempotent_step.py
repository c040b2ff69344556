"""A retried train step or publish (same ``job_id``) is answered with the first reply, on a real
nats-server: no second optimizer step, no second weight version; every reply carries the trainer's
incarnation, so the controller can tell a restarted trainer from the one it configured."""

# ruff: noqa: F811  (test_worker's `trainer` fixture, imported, is every test's argument)

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_worker import SCORES, Trainer, _rollouts, trainer  # noqa: F401  (the fixture)

from rlfleet.common.control.messages import (
    LatestWeights,
    PublishWeights,
    SaveCheckpoint,
    Saved,
    TrainerConfigure,
    TrainerConfigured,
    TrainStepRequest,
    TrainStepResult,
    WeightsPublished,
)
from rlfleet.common.errors import RemoteUserError
from rlfleet.common.schema.trainer import ModelSettings, StepSettings, UpdateSettings
from rlfleet.trainer.errors import JobIdReused
from rlfleet.trainer.idempotency import ReplyCache

pytestmark = pytest.mark.timeout(120)

SETTINGS = StepSettings(update=UpdateSettings(learning_rate=1e-2, micro_batch_size=2, kl_coef=0.0))


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.worker.actor.model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


async def test_a_repeated_step_job_is_answered_without_a_second_update(
    trainer: Trainer, make_batch: Callable[..., dict[str, torch.Tensor]]
) -> None:
    ref = trainer.put(_rollouts(make_batch))
    request = TrainStepRequest(
        step=1, rollouts=[ref], scores=SCORES, settings=SETTINGS, job_id="run-a/step-1"
    )
    before = _weights(trainer)
    first = await trainer.ask("step", request)
    assert isinstance(first, TrainStepResult)
    assert first.incarnation == trainer.worker.incarnation and len(first.incarnation) == 16
    after = _weights(trainer)
    assert not _same(before, after), "the first request trains"
    steps = trainer.worker.actor.steps
    again = await trainer.ask("step", request)
    assert again == first  # the same reply, metrics and all
    assert trainer.worker.actor.steps == steps and _same(after, _weights(trainer)), "no second update"
    # two copies at once (a retry racing the first attempt): one update between them
    twice = TrainStepRequest(step=2, rollouts=[ref], scores=SCORES, settings=SETTINGS, job_id="run-a/step-2")
    a, b = await asyncio.gather(trainer.ask("step", twice), trainer.ask("step", twice))
    assert a == b and trainer.worker.actor.steps == steps + 1
    # a new job id is a new step; a request without one (an older controller) always steps
    fresh = request.model_copy(update={"job_id": "run-a/step-3"})
    assert isinstance(await trainer.ask("step", fresh), TrainStepResult)
    anonymous = request.model_copy(update={"job_id": ""})
    await trainer.ask("step", anonymous)
    await trainer.ask("step", anonymous)
    assert trainer.worker.actor.steps == steps + 4


async def test_a_job_id_reused_for_another_request_is_refused_naming_the_fields(
    trainer: Trainer, make_batch: Callable[..., dict[str, torch.Tensor]]
) -> None:
    ref = trainer.put(_rollouts(make_batch))
    request = TrainStepRequest(step=1, rollouts=[ref], scores=SCORES, settings=SETTINGS, job_id="job-7")
    await trainer.ask("step", request)
    steps = trainer.worker.actor.steps
    other = request.model_copy(update={"step": 2, "scores": [0.0, 0.0, 0.0, 1.0]})
    with pytest.raises(
        RemoteUserError, match=r"job_id 'job-7' was first used for another request"
    ) as refused:
        await trainer.ask("step", other)
    assert refused.value.code == "bad_request" and "scores, step" in refused.value.remote_message
    assert trainer.worker.actor.steps == steps


async def test_a_repeated_publish_job_makes_no_second_version_and_replies_carry_the_incarnation(
    trainer: Trainer, tmp_path: Path
) -> None:
    incarnation = trainer.worker.incarnation
    configured = await trainer.ask(
        "configure",
        TrainerConfigure(
            model=ModelSettings(sharding="full", mixed_precision="none"), device="cpu", critic=False
        ),  # fmt: skip
    )
    assert isinstance(configured, TrainerConfigured) and configured.incarnation == incarnation
    publish = PublishWeights(bucket_mb=0.05, job_id="publish-1")  # -1: the next version
    first = await trainer.ask("publish", publish)
    assert isinstance(first, WeightsPublished) and first.weight_version == 1
    again = await trainer.ask("publish", publish)
    assert again == first and trainer.worker.weight_version == 1, "no version 2 from a retry"
    assert first.incarnation == incarnation
    second = await trainer.ask("publish", publish.model_copy(update={"job_id": "publish-2"}))
    assert isinstance(second, WeightsPublished) and second.weight_version == 2
    latest = await trainer.ask("latest", LatestWeights(worker_id="rollout-9"))
    assert isinstance(latest, WeightsPublished) and latest.incarnation == incarnation
    trainer.worker.config.checkpoint_root = str(tmp_path)
    saved = await trainer.ask("save", SaveCheckpoint(path=str(tmp_path / "hf")))
    assert isinstance(saved, Saved) and saved.incarnation == incarnation


async def test_a_failed_job_is_forgotten_so_that_its_retry_runs_again() -> None:
    cache = ReplyCache(size=2)
    request = PublishWeights(job_id="p")
    calls: list[int] = []

    async def failing() -> str:
        calls.append(1)
        raise ConnectionError("store gone")

    for _ in range(2):
        with pytest.raises(ConnectionError):
            await cache.once(request, "p", failing)
    assert len(calls) == 2 and len(cache) == 0

    async def works() -> str:
        calls.append(1)
        return "ok"

    assert await cache.once(request, "p", works) == "ok"
    assert await cache.once(request, "p", works) == "ok" and len(calls) == 3
    for job in ("q", "r", "s"):  # only the last `size` job ids are kept
        await cache.once(request.model_copy(update={"job_id": job}), job, works)
    assert len(cache) == 2
    with pytest.raises(JobIdReused, match="differs in bucket_mb"):
        await cache.once(PublishWeights(job_id="s", bucket_mb=1.0), "s", works)
