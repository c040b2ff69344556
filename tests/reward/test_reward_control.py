"""The controller side of the reward tier: which reward functions can travel, and version metrics."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rlfleet.controller.errors import RewardFnNotPortable
from rlfleet.controller.reward_control import RewardControl, describe_reward_fn, model_swap, revision_of
from rlfleet.reward import RewardScaler, build_reward
from rlfleet.reward.answers import extract_number
from rlfleet.reward.user import import_function


def test_specs_travel_as_they_are() -> None:
    assert describe_reward_fn("numeric + 0.1*concise") == {"spec": "numeric + 0.1*concise"}
    spec = {"components": [{"name": "numeric"}]}
    assert describe_reward_fn(spec) == {"spec": spec}
    wire = {"spec": "concise", "scaler": {"temperature": 0.7}}
    assert describe_reward_fn(wire) == wire
    with pytest.raises(RewardFnNotPortable, match="unknown keys \\['fn'\\]"):
        describe_reward_fn({"spec": "concise", "fn": 1})
    with pytest.raises(RewardFnNotPortable, match="empty"):
        describe_reward_fn("  ")


def test_built_rewards_and_scalers_describe_themselves() -> None:
    reward = build_reward("concise:max_words=7")
    assert build_reward(describe_reward_fn(reward)["spec"]).version == reward.version
    scaler = RewardScaler(fn=reward, temperature=0.7, min_reward=0.1, normalize=True)
    scaler([1.0, 2.0])
    for fn in (scaler, scaler.compute_reward):
        wire = describe_reward_fn(fn)
        assert wire["scaler"]["temperature"] == 0.7 and wire["scaler_state"]["count"] == 2
        assert build_reward(wire["spec"]).version == reward.version


def test_importable_functions_travel_by_name() -> None:
    wire = describe_reward_fn(extract_number)
    assert wire == {"spec": "rlfleet.reward.answers:extract_number"}
    assert import_function(wire["spec"]) is extract_number


def test_live_code_that_cannot_be_imported_is_refused() -> None:
    def local(prompt: str, response: str) -> float:
        return 0.0

    with pytest.raises(RewardFnNotPortable, match="not a top-level function"):
        describe_reward_fn(local)
    with pytest.raises(RewardFnNotPortable, match="not a top-level function"):
        describe_reward_fn(lambda p, r: 0.0)
    with pytest.raises(RewardFnNotPortable, match="plain callable"):
        describe_reward_fn(RewardScaler(fn=lambda prompts, responses: [0.0]).compute_reward)
    with pytest.raises(RewardFnNotPortable, match="neither a spec nor a function"):
        describe_reward_fn(3)


def test_model_swap_keeps_the_spec_for_a_directory(tmp_path: Path) -> None:
    assert model_swap(str(tmp_path), "rm") == {"model_path": str(tmp_path), "component": "rm"}
    assert model_swap("concise", None) == {"spec": "concise"}
    with pytest.raises(RewardFnNotPortable, match="component="):
        model_swap("concise", "rm")


def test_step_metrics_flag_the_step_where_the_version_changed(caplog: pytest.LogCaptureFixture) -> None:
    control = RewardControl(transport=None, cluster="c", registry=None, token="", request_timeout=1.0)  # type: ignore[arg-type]
    steps = [["aaa-r0", "aaa-r0"], ["aaa-r0"], ["aaa-r0", "bbb-r1"], ["bbb-r1"], []]
    seen = []
    with caplog.at_level(logging.INFO, logger="rlfleet.controller.reward_control"):
        for step, versions in enumerate(steps, start=1):
            control._step_versions.extend(versions)
            seen.append(control.step_metrics(step))
    assert [m.get("reward/spec_version_changed") for m in seen] == [0.0, 0.0, 1.0, 0.0, None]
    assert [m.get("reward/spec_revision") for m in seen] == [0.0, 0.0, 1.0, 1.0, None]
    assert seen[2]["reward/spec_versions_in_step"] == 2.0
    assert "step 3: reward version aaa-r0 -> bbb-r1" in caplog.text
    assert revision_of("abc-r12") == 12 and revision_of("weird") == -1
