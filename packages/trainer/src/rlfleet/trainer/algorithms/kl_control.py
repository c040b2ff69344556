"""KL coefficient controllers (fixed, adaptive, scheduled) and the config that picks one.

They live in :mod:`rlfleet.common.kl_control` (no torch) because the controller runs them between
steps; this module re-exports them beside the other algorithm pieces.
"""

from __future__ import annotations

from rlfleet.common.kl_control import (
    ADAPTIVE_ERROR_CLIP,
    KL_CONTROLLERS,
    AdaptiveKLController,
    AnyKLController,
    FixedKLController,
    KLControlConfig,
    KLControlKind,
    KLController,
    KLSchedule,
    ScheduledKLController,
    build_kl_controller,
)

__all__ = [
    "ADAPTIVE_ERROR_CLIP",
    "KL_CONTROLLERS",
    "AdaptiveKLController",
    "AnyKLController",
    "FixedKLController",
    "KLControlConfig",
    "KLControlKind",
    "KLController",
    "KLSchedule",
    "ScheduledKLController",
    "build_kl_controller",
]
