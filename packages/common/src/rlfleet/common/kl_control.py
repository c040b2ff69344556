"""KL coefficient controllers (fixed, adaptive, scheduled) and the config that picks one.

The KL-to-reference term enters either the reward (``mode="reward"``: ``r_t -= coef * kl_t``, PPO
as in OpenRLHF/verl) or the loss (``mode="loss"``: ``+ coef * kl``, GRPO). Its coefficient comes
from a controller:

- :class:`FixedKLController`: a constant;
- :class:`AdaptiveKLController`: Ziegler et al. (2019), moves the coefficient so the measured KL
  approaches ``target``: ``err = clip(kl / target - 1, -0.2, 0.2)``,
  ``coef *= 1 + err * n_steps / horizon``;
- :class:`ScheduledKLController`: linear or cosine from ``start`` to ``end`` over ``total_steps``.

Every controller has ``.value`` (settable between steps, as ``trainer.kl_coef = x``),
``.update(current_kl, n_steps)`` once per step, and ``state_dict()`` / ``load_state_dict()`` that
round-trip exactly (plain Python numbers, JSON-safe) for resume. ``n_steps`` is whatever unit the
caller counts in (verl and OpenRLHF pass the number of samples of the step); ``horizon`` and
``total_steps`` are in that same unit.

This module lives in rlfleet-common (pure Python, no torch) because both sides use it: the
controller runs the controller between steps (it owns ``trainer.kl_coef`` and saves the state with
its checkpoints) and the trainer re-exports it from ``rlfleet.trainer.algorithms``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal, Protocol

from pydantic import Field, model_validator

from rlfleet.common.config import ConfigModel
from rlfleet.common.errors import ConfigError

logger = logging.getLogger(__name__)

KLControlKind = Literal["fixed", "adaptive", "scheduled"]
KLSchedule = Literal["linear", "cosine"]
ADAPTIVE_ERROR_CLIP = 0.2
"""Bound on the proportional error of the adaptive controller (Ziegler et al.)."""


class KLController(Protocol):
    """What every KL controller offers."""

    kind: str
    value: float

    def update(self, current_kl: float, n_steps: int = 1) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _check_kind(state: dict[str, Any], kind: str, keys: tuple[str, ...]) -> None:
    """Raise ConfigError when a saved state is of another controller kind or lacks a key."""
    saved = state.get("kind")
    if saved != kind:
        raise ConfigError(
            "kl_control.kind",
            saved,
            f"the checkpoint holds a {saved!r} KL controller but the config builds {kind!r}",
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise ConfigError("kl_control", sorted(state), f"saved {kind} controller state lacks {missing}")


class FixedKLController:
    """A constant coefficient; ``update`` does nothing."""

    kind = "fixed"

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind, ("value",))
        self.value = float(state["value"])

    @classmethod
    def from_config(cls, cfg: KLControlConfig) -> FixedKLController:
        return cls(cfg.coef)


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller towards a target KL."""

    kind = "adaptive"

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0.0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0; got {target} and {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""
        error = min(max(float(current_kl) / self.target - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind, ("value", "target", "horizon"))
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])

    @classmethod
    def from_config(cls, cfg: KLControlConfig) -> AdaptiveKLController:
        assert cfg.target is not None  # the config validator requires it for kind=adaptive
        return cls(cfg.coef, cfg.target, cfg.horizon)


class ScheduledKLController:
    """A coefficient that follows a linear or cosine schedule from ``start`` to ``end``.

    Setting ``value`` by hand pins it: the schedule stops and the set value holds (and is saved)
    from then on.
    """

    kind = "scheduled"

    def __init__(self, start: float, end: float, total_steps: int, schedule: KLSchedule = "linear") -> None:
        if total_steps <= 0:
            raise ValueError(f"scheduled KL needs total_steps > 0; got {total_steps}")
        if schedule not in ("linear", "cosine"):
            raise ValueError(f"schedule must be 'linear' or 'cosine'; got {schedule!r}")
        self.start, self.end = float(start), float(end)
        self.total_steps = int(total_steps)
        self.schedule: KLSchedule = schedule
        self.step = 0
        self.pinned: float | None = None

    @property
    def value(self) -> float:
        """The coefficient at the current step (or the pinned value)."""
        if self.pinned is not None:
            return self.pinned
        frac = min(self.step / self.total_steps, 1.0)
        if self.schedule == "linear":
            return self.start + (self.end - self.start) * frac
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * frac))

    @value.setter
    def value(self, coef: float) -> None:
        self.pinned = float(coef)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """Advance the schedule by ``n_steps``; the measured KL is not used."""
        self.step += int(n_steps)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "start": self.start,
            "end": self.end,
            "total_steps": self.total_steps,
            "schedule": self.schedule,
            "step": self.step,
            "pinned": self.pinned,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind, ("start", "end", "total_steps", "schedule", "step", "pinned"))
        self.start, self.end = float(state["start"]), float(state["end"])
        self.total_steps = int(state["total_steps"])
        self.schedule = state["schedule"]
        self.step = int(state["step"])
        self.pinned = None if state["pinned"] is None else float(state["pinned"])

    @classmethod
    def from_config(cls, cfg: KLControlConfig) -> ScheduledKLController:
        assert cfg.total_steps is not None  # the config validator requires it for kind=scheduled
        return cls(cfg.coef, cfg.end_coef, cfg.total_steps, cfg.schedule)


AnyKLController = FixedKLController | AdaptiveKLController | ScheduledKLController

KL_CONTROLLERS: dict[str, type[AnyKLController]] = {
    "fixed": FixedKLController,
    "adaptive": AdaptiveKLController,
    "scheduled": ScheduledKLController,
}
"""Controller kind -> class; every class has ``from_config(cfg: KLControlConfig)``."""


class KLControlConfig(ConfigModel):
    """Where the KL-to-reference term goes, how it is estimated, and how its coefficient moves."""

    kind: KLControlKind = Field(default="fixed", description="coefficient controller")
    coef: float = Field(
        default=0.0, ge=0.0, description="fixed coefficient; initial one (adaptive); start (scheduled)"
    )
    target: float | None = Field(default=None, gt=0.0, description="adaptive: the KL to steer towards")
    horizon: int = Field(default=10000, ge=1, description="adaptive: steps (in n_steps units) to react")
    schedule: KLSchedule = Field(default="linear", description="scheduled: the curve from coef to end_coef")
    end_coef: float = Field(default=0.0, ge=0.0, description="scheduled: the final coefficient")
    total_steps: int | None = Field(
        default=None, ge=1, description="scheduled: steps (in n_steps units) from coef to end_coef"
    )
    mode: Literal["loss", "reward"] = Field(
        default="loss", description="add coef*KL to the loss (GRPO) or subtract it from the reward (PPO)"
    )
    estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3", description="per-token KL estimator (k1 is usual in the reward, k3 in the loss)"
    )

    @model_validator(mode="after")
    def _kind_needs_its_fields(self) -> KLControlConfig:
        if self.kind == "adaptive" and (self.target is None or self.coef <= 0.0):
            raise ValueError(
                "kind 'adaptive' needs target > 0 and coef > 0 (a multiplicative controller "
                "started at 0 stays at 0); set kl_control.target and kl_control.coef"
            )
        if self.kind == "scheduled" and self.total_steps is None:
            raise ValueError("kind 'scheduled' needs total_steps; set kl_control.total_steps")
        return self

    @property
    def enabled(self) -> bool:
        """Whether any coefficient of the run can be non-zero (then a reference model is needed)."""
        return self.coef > 0.0 or (self.kind == "scheduled" and self.end_coef > 0.0)


def build_kl_controller(cfg: KLControlConfig) -> AnyKLController:
    """The controller ``cfg.kind`` names, initialized from ``cfg``."""
    return KL_CONTROLLERS[cfg.kind].from_config(cfg)
