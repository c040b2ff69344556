"""The controller side of the reward tier: which reward functions can travel, and version metrics."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rlfleet.controller.errors import RewardFnNotPortable
from rlfleet.controller.python_reward import PythonReward, is_python_reward
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


def test_function_names_travel_and_callables_stay_in_the_controller() -> None:
    """A 'module:function' name goes to the reward worker, which imports it; a callable object (an
    importable function, a lambda, a closure, a scaler of a plain callable's compute_reward) is a
    Python reward the controller calls itself: nothing of it is sent."""
    assert describe_reward_fn("rlfleet.reward.answers:extract_number") == {
        "spec": "rlfleet.reward.answers:extract_number"
    }
    assert import_function("rlfleet.reward.answers:extract_number") is extract_number

    def local(prompt: str, response: str) -> float:
        return 0.0

    scaler = RewardScaler(fn=lambda prompts, responses: [0.0])
    for fn in (extract_number, local, lambda text: 0.0, scaler.compute_reward):
        wire = describe_reward_fn(fn)
        assert set(wire) == {"python"} and isinstance(wire["python"], PythonReward)
        assert wire["python"].fn is fn


def test_scaler_compute_reward_of_a_plain_callable_is_called_here() -> None:
    scaler = RewardScaler(fn=lambda prompts, responses: [float(len(r)) for r in responses], temperature=0.5)
    reward = PythonReward(scaler.compute_reward)
    assert reward.style == "batch" and reward(["2+2?", "3+4?"], ["4", "seven"], [{}, {}]) == [2.0, 10.0]
    assert is_python_reward(scaler.compute_reward) is False, "it describes itself first (a spec if it can)"


def test_what_is_neither_a_spec_nor_callable_is_refused() -> None:
    with pytest.raises(RewardFnNotPortable, match="plain callable"):
        describe_reward_fn(RewardScaler(fn=lambda prompts, responses: [0.0]))  # the scaler, not its method
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
