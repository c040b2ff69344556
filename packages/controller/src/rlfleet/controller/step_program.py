"""What a run and its step programs share: a step's result, the step program, and the KL controller.

:class:`~rlfleet.controller.run.FleetRun` drives a :class:`StepProgram` (online RL in
:mod:`rlfleet.controller.online`, DPO in :mod:`rlfleet.controller.dpo`) one dataset batch at a
time and yields a :class:`StepResult` per step; the online programs' KL coefficient comes from a
:class:`KLController`. Moved out of run.py (which still exports them) as one idea.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rlfleet.controller.dataset import PromptItem


@dataclass
class StepResult:
    """What one step produced: its metrics and where it stands."""

    step: int
    epoch: int
    metrics: dict[str, float]
    weight_version: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    routes: dict[str, Any] = field(default_factory=dict)
    """Where the step's prompts went (GRPO/PPO): route -> :class:`rlfleet.controller.routing.RouteSummary`."""


class StepProgram(Protocol):
    """One algorithm family's step: what it asks of the tiers for one dataset batch."""

    last_routes: dict[str, Any]
    """Where the last step's prompts went (empty for a step that generates nothing)."""

    async def step(self, batch: list[PromptItem]) -> dict[str, float]: ...


class KLController(Protocol):
    """What the run needs of its KL coefficient controller (they are the online step program's:
    :mod:`rlfleet.controller.online`): the value of the next step, settable between steps; each
    step's update; its state, for checkpoints."""

    kind: str
    value: float

    def update(self, current_kl: float, n_steps: int = 1) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
