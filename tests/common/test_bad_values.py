"""Bad values are refused where they arrive, with errors that name the field and the value: sampling
parameters, step hyperparameters, token ids and scores (issue 12, point 7)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlfleet.common.control.messages import GenerateRequest, SamplingParams, TrainStepRequest, decode
from rlfleet.common.errors import MessageDecodeError
from rlfleet.common.schema.trainer import StepSettings

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", "NaN"), ("temperature", -1.0), ("temperature", 1e9), ("top_p", "Infinity"),
     ("top_p", 0.0), ("top_k", 0), ("top_k", -2), ("max_tokens", 0), ("n", 0), ("seed", -1)],
)  # fmt: skip
def test_sampling_parameters_are_bounded(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as refused:
        SamplingParams.model_validate({field: value})
    assert field in str(refused.value) and str(value) in str(refused.value)


def test_token_ids_are_never_negative_and_a_wire_request_naming_one_is_refused() -> None:
    with pytest.raises(ValidationError, match="prompt_token_ids"):
        GenerateRequest(job_id="j", prompt_token_ids=[[3, -1]])
    with pytest.raises(ValidationError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-5])
    wire = b'{"protocol": "2.1", "kind": "rollout.generate", "job_id": "j", "prompt_token_ids": [[1, -7]]}'
    with pytest.raises(MessageDecodeError, match="prompt_token_ids"):
        decode(wire)
    assert GenerateRequest(job_id="j", prompt_token_ids=[[0, 5]]).prompt_token_ids == [[0, 5]]


@pytest.mark.parametrize(
    ("field", "value"),
    [("learning_rate", "Infinity"), ("learning_rate", "NaN"), ("entropy_coef", "NaN"),
     ("kl_coef", "Infinity"), ("max_grad_norm", "Infinity"), ("clip_eps", "NaN")],
)  # fmt: skip
def test_step_hyperparameters_must_be_finite(field: str, value: str) -> None:
    with pytest.raises(ValidationError) as refused:
        StepSettings.model_validate({field: value})
    assert field in str(refused.value) and "finite" in str(refused.value)


def test_scores_must_be_finite_and_steps_not_negative() -> None:
    with pytest.raises(ValidationError, match="scores"):
        TrainStepRequest.model_validate({"step": 1, "rollouts": [], "scores": ["NaN"]})
    with pytest.raises(ValidationError, match="step"):
        TrainStepRequest(step=-1, rollouts=[], scores=[])
