"""KL controllers: hand-computed updates, schedules, manual overrides, exact resume, config."""

from __future__ import annotations

import json
import math
from typing import get_args

import pytest
from pydantic import TypeAdapter, ValidationError

from rlfleet.common.errors import ConfigError
from rlfleet.controller.config import (
    AdaptiveKL,
    FixedKL,
    KLControl,
    KLControlKind,
    ScheduledKL,
    TrainerConfig,
)
from rlfleet.controller.online import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    ScheduledKLController,
    build_kl_controller,
)
from rlfleet.controller.ports import KLController


def test_fixed_controller_ignores_the_kl_and_can_be_set() -> None:
    ctl = FixedKLController(0.1)
    ctl.update(123.0, n_steps=64)
    assert ctl.value == 0.1
    ctl.value = 0.3  # `trainer.kl_coef = 0.3` between steps
    ctl.update(0.0)
    assert ctl.value == 0.3


def test_adaptive_controller_by_hand() -> None:
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(9.0, n_steps=64)
    # err = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2; coef = 0.1 * (1 + 0.2 * 64 / 10000) = 0.100128
    assert ctl.value == pytest.approx(0.100128, rel=1e-12)
    ctl.update(3.0, n_steps=64)
    # err = clip(3/6 - 1 = -0.5) = -0.2; coef = 0.100128 * (1 - 0.00128) = 0.09999983616
    assert ctl.value == pytest.approx(0.09999983616, rel=1e-12)
    ctl.update(6.6, n_steps=64)
    # err = 6.6/6 - 1 = 0.1 (inside the clip); coef *= 1 + 0.1 * 64 / 10000 = 1.00064
    assert ctl.value == pytest.approx(0.09999983616 * 1.00064, rel=1e-12)
    ctl.update(6.0, n_steps=64)  # on target: no change
    assert ctl.value == pytest.approx(0.09999983616 * 1.00064, rel=1e-12)


def test_adaptive_controller_continues_from_a_manual_value() -> None:
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=10)
    ctl.value = 0.5
    ctl.update(2.0, n_steps=1)  # err 0.2 -> 0.5 * 1.02
    assert ctl.value == pytest.approx(0.51)


def test_adaptive_controller_refuses_bad_target() -> None:
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_linear_schedule_by_hand() -> None:
    ctl = ScheduledKLController(start=1.0, end=0.0, total_steps=4, schedule="linear")
    seen = []
    for _ in range(6):
        seen.append(ctl.value)
        ctl.update(0.0)
    assert seen == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])  # holds `end` after total_steps


def test_cosine_schedule_by_hand_and_n_steps() -> None:
    ctl = ScheduledKLController(start=1.0, end=0.2, total_steps=4, schedule="cosine")
    assert ctl.value == pytest.approx(1.0)
    ctl.update(0.0, n_steps=1)
    # 0.2 + 0.8 * 0.5 * (1 + cos(pi/4))
    assert ctl.value == pytest.approx(0.2 + 0.4 * (1 + math.cos(math.pi / 4)))
    ctl.update(0.0, n_steps=1)
    assert ctl.value == pytest.approx(0.6)  # halfway: the midpoint
    ctl.update(0.0, n_steps=2)
    assert ctl.value == pytest.approx(0.2)


def test_setting_a_scheduled_value_pins_it() -> None:
    ctl = ScheduledKLController(start=1.0, end=0.0, total_steps=4)
    ctl.update(0.0)
    ctl.value = 0.9
    ctl.update(0.0)
    ctl.update(0.0)
    assert ctl.value == 0.9


def _drive(ctl: KLController, kls: list[float]) -> list[float]:
    out = []
    for kl in kls:
        ctl.update(kl, n_steps=32)
        out.append(ctl.value)
    return out


CONFIGS = {  # kind -> (the kl section, start coefficient)
    "fixed": (FixedKL(type="fixed"), 0.05),
    "adaptive": (AdaptiveKL(type="adaptive", target=0.5, horizon=1000), 0.2),
    "scheduled": (ScheduledKL(type="scheduled", end_coef=0.01, total_steps=500, schedule="cosine"), 0.3),
}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_state_dict_round_trip_resumes_exactly(kind: str) -> None:
    kls = [0.9, 0.1, 0.7, 0.33, 1.5, 0.0, 0.2, 0.51]
    uninterrupted = build_kl_controller(*CONFIGS[kind])
    expected = _drive(uninterrupted, kls)
    first = build_kl_controller(*CONFIGS[kind])
    _drive(first, kls[:3])
    saved = json.loads(json.dumps(first.state_dict()))  # through JSON, as a checkpoint stores it
    resumed = build_kl_controller(*CONFIGS[kind])
    resumed.load_state_dict(saved)
    assert _drive(resumed, kls[3:]) == expected[3:]  # bit-exact, not approximately
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_pinned_scheduled_value_survives_resume() -> None:
    ctl = ScheduledKLController(start=1.0, end=0.0, total_steps=10)
    ctl.value = 0.42
    fresh = ScheduledKLController(start=1.0, end=0.0, total_steps=10)
    fresh.load_state_dict(ctl.state_dict())
    fresh.update(0.0)
    assert fresh.value == 0.42


def test_loading_another_kind_or_a_partial_state_is_refused() -> None:
    adaptive = AdaptiveKLController(0.1, target=1.0, horizon=10)
    with pytest.raises(ConfigError, match="'fixed'"):
        adaptive.load_state_dict(FixedKLController(0.1).state_dict())
    with pytest.raises(ConfigError, match="lacks"):
        adaptive.load_state_dict({"kind": "adaptive", "value": 0.1})


def test_registry_and_sections_name_the_same_kinds() -> None:
    assert set(KL_CONTROLLERS) == set(get_args(KLControlKind)) == {"fixed", "adaptive", "scheduled"}
    tags = {member.model_fields["type"].annotation for member in (FixedKL, AdaptiveKL, ScheduledKL)}
    assert {arg for tag in tags for arg in get_args(tag)} == set(get_args(KLControlKind))
    for kind, (section, coef) in CONFIGS.items():
        ctl = build_kl_controller(section, coef)
        assert isinstance(ctl, KL_CONTROLLERS[kind])
        assert ctl.kind == kind == section.type  # a checkpoint's saved kind is the section's type
        assert ctl.value == pytest.approx(coef)


def test_the_controller_needs_the_settings_of_its_kind() -> None:
    kl: TypeAdapter[KLControl] = TypeAdapter(KLControl)
    with pytest.raises(ValidationError, match=r"adaptive\.target\n  Field required"):
        kl.validate_python({"type": "adaptive"})
    with pytest.raises(ValueError, match="kl_coef > 0"):
        build_kl_controller(AdaptiveKL(type="adaptive", target=1.0), 0.0)
    with pytest.raises(ValidationError, match=r"scheduled\.total_steps\n  Field required"):
        kl.validate_python({"type": "scheduled"})
    with pytest.raises(ValidationError, match="extra"):
        FixedKL(type="fixed", kl_coef=0.1)  # type: ignore[call-arg]  # kl_coef is a step setting (update)


def test_the_run_config_builds_its_controller_from_kl_and_update_kl_coef() -> None:
    config = TrainerConfig(kl={"type": "adaptive", "target": 0.5, "horizon": 1000}, update={"kl_coef": 0.2})
    ctl = build_kl_controller(config.kl, config.update.kl_coef)
    assert isinstance(ctl, AdaptiveKLController) and (ctl.value, ctl.target, ctl.horizon) == (0.2, 0.5, 1000)
    with pytest.raises(ValidationError, match="kl type 'adaptive' needs kl_coef > 0"):
        TrainerConfig(kl={"type": "adaptive", "target": 0.5}, kl_coef=0.0)
    assert TrainerConfig(kl={}).kl == FixedKL(type="fixed")  # a kl without a type is fixed
    assert TrainerConfig(kl="fixed").kl == FixedKL(type="fixed")  # the tag alone


@pytest.mark.parametrize(
    "saved",
    [
        {"kind": "fixed", "value": 0.07},
        {"kind": "adaptive", "value": 0.11, "target": 0.5, "horizon": 1000},
        {"kind": "scheduled", "start": 0.3, "end": 0.01, "total_steps": 500, "schedule": "cosine", "step": 64,
         "pinned": None},
    ],
    ids=lambda saved: saved["kind"],
)  # fmt: skip
def test_a_checkpoint_of_the_previous_release_resumes_under_the_kl_section(saved: dict[str, object]) -> None:
    """The saved state's ``kind`` is the section's ``type`` (the previous release's ``kl_ctrl``)."""
    section, coef = CONFIGS[str(saved["kind"])]
    ctl = build_kl_controller(section, coef)
    ctl.load_state_dict(json.loads(json.dumps(saved)))
    assert ctl.state_dict() == saved
