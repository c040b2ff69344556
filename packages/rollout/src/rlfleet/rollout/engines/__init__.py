"""Rollout engines behind one protocol: :class:`Engine`, its implementations and their registry."""

from rlfleet.rollout.engines.base import Completion, Engine, FinishReason, WeightsInput
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.rollout.engines.registry import ENGINES, make_engine

__all__ = [
    "ENGINES",
    "Completion",
    "Engine",
    "FinishReason",
    "HFEngine",
    "WeightsInput",
    "make_engine",
]
