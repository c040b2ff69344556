"""A step whose gradient is not finite skips its update, is reported with the metric as it is (NaN and
inf travel on a real nats-server) and the trainer goes on; a NaN score is refused where it arrives."""

# ruff: noqa: F811  (test_worker's `trainer` fixture, imported, is every test's argument)
from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from pydantic import ValidationError
from test_worker import SCORES, Trainer, _rollouts, trainer  # noqa: F401  (the fixture)

from rlfleet.common.control.messages import TrainStepRequest, TrainStepResult, decode
from rlfleet.common.schema.trainer import StepSettings, UpdateSettings

pytestmark = pytest.mark.timeout(120)

SETTINGS = StepSettings(update=UpdateSettings(learning_rate=1e-2, micro_batch_size=2, kl_coef=0.0))


async def test_an_infinite_gradient_skips_the_update_and_the_step_is_reported(
    trainer: Trainer, make_batch: Callable[..., dict[str, torch.Tensor]]
) -> None:
    ref = trainer.put(_rollouts(make_batch))
    actor = trainer.worker.actor
    param = next(p for p in actor.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda grad: grad * math.inf)  # an overflowing gradient
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    steps = actor.steps
    result = await trainer.ask(
        "step", TrainStepRequest(step=1, rollouts=[ref], scores=SCORES, settings=SETTINGS)
    )
    hook.remove()
    assert isinstance(result, TrainStepResult)
    assert not math.isfinite(result.metrics["grad_norm"]) and result.metrics["update_skipped"] == 1.0
    assert math.isfinite(result.metrics["loss"])
    assert all(torch.equal(before[n], p) for n, p in actor.model.named_parameters()), "no update applied"
    assert actor.steps == steps + 1  # the step counts (schedule advanced)
    # the run goes on: the next step trains
    ok = await trainer.ask("step", TrainStepRequest(step=2, rollouts=[ref], scores=SCORES, settings=SETTINGS))
    assert isinstance(ok, TrainStepResult) and ok.metrics["update_skipped"] == 0.0
    assert not all(torch.equal(before[n], p) for n, p in actor.model.named_parameters())


def test_non_finite_metrics_travel_and_non_finite_scores_are_refused() -> None:
    result = TrainStepResult(step=1, metrics={"a": math.nan, "b": math.inf, "c": -math.inf}, weight_version=0)
    back = decode(result.model_dump_json())
    assert isinstance(back, TrainStepResult) and math.isnan(back.metrics["a"])
    assert back.metrics["b"] == math.inf and back.metrics["c"] == -math.inf
    for bad in ("NaN", "Infinity"):
        with pytest.raises(ValidationError, match="finite"):
            TrainStepRequest.model_validate({"step": 1, "rollouts": [], "scores": [1.0, bad]})
