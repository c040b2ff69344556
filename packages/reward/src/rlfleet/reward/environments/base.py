"""What an environment is: :class:`Environment` (one episode's state, under its options) and
:class:`Observation` (its answer to a reset or a step).

An environment is a pydantic model: its fields are the options the operator's spec fixes
(validated when the reward worker starts, like a rule's), its private attributes one episode's
state. Each episode gets a fresh instance (:meth:`ConfiguredEnvironment.new
<rlfleet.reward.environments.registry.ConfiguredEnvironment.new>`), so an instance is never shared
between episodes or threads.

:meth:`Environment.step` does what every environment shares: it counts turns, runs the turn's
tool calls on the tools the options allow (a turn with a call gets their results, role ``tool``)
and ends the episode (reward 0) at ``max_turns``. A subclass writes :meth:`Environment.begin` (the
episode's start, from the dataset item and the seed) and :meth:`Environment.respond` (its answer
to a turn without tool calls). Model text never raises: whatever it is, it gets an observation.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from rlfleet.reward.environments.tools import TOOLS, Tool, ToolTurn, run_turn

logger = logging.getLogger(__name__)

TURN_LIMIT_NOTE = "(turn limit reached: the episode is over)"


@dataclass(frozen=True)
class Observation:
    """An environment's answer: text to append as the next turn, in ``role``; the episode's reward
    once ``done``; per-step counts in ``info`` (``tool_calls``, ``tool_errors``, ``malformed_calls``)."""

    text: str = ""
    role: Literal["tool", "user"] = "user"
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, float] = field(default_factory=dict)


class Environment(BaseModel):
    """Base of the built-in environments; see the module docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
    kind: ClassVar[str] = ""
    """The environment's name in :data:`~rlfleet.reward.environments.registry.ENVIRONMENTS`."""

    max_turns: int = Field(
        default=4, ge=1, le=100, description="model turns before the episode ends (reward 0)"
    )
    tools: tuple[str, ...] = Field(default=(), description="tools the model may call, or 'a|b' (of TOOLS)")
    max_tool_calls: int = Field(default=4, ge=1, le=32, description="tool calls run in one turn")
    _toolbox: Mapping[str, Tool] = PrivateAttr(default_factory=dict)
    _turns: int = PrivateAttr(default=0)

    @field_validator("tools", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        """Accept ``"calculator|python"`` (the text form of a spec) as well as a list."""
        if isinstance(value, str):
            return [part.strip() for part in value.split("|") if part.strip()]
        return value

    @field_validator("tools")
    @classmethod
    def _known(cls, tools: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [t for t in tools if t not in TOOLS]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; the tools are {sorted(TOOLS)}")
        return tools

    def equip(self, toolbox: Mapping[str, Tool]) -> None:
        """Give this episode its tools (built once per configured environment, shared by its episodes)."""
        self._toolbox = toolbox

    @property
    def turns(self) -> int:
        """Model turns taken so far in this episode."""
        return self._turns

    def reset(self, item: Mapping[str, Any], seed: int) -> Observation:
        """Start the episode from a dataset ``item`` (and ``seed``, for what the item leaves to chance)."""
        self._turns = 0
        return self.begin(item, seed)

    def step(self, action: str, *, deadline: float | None = None) -> Observation:
        """The answer to the model's turn ``action``; its tools stop at ``deadline`` (UNIX seconds)."""
        self._turns += 1
        last = self._turns >= self.max_turns
        turn = (
            run_turn(action, self._toolbox, self.max_tool_calls, deadline)
            if self._toolbox
            else ToolTurn(False)
        )
        if turn.called:
            text = f"{turn.text}\n\n{TURN_LIMIT_NOTE}" if last else turn.text
            return Observation(text, "tool", 0.0, done=last, info=turn.info())
        answer = self.respond(action)
        if last and not answer.done:
            answer = replace(answer, done=True, reward=0.0)
        return replace(answer, info={**turn.info(), **answer.info})

    @abstractmethod
    def begin(self, item: Mapping[str, Any], seed: int) -> Observation:
        """Set up the episode's state; :class:`~rlfleet.reward.errors.BadEnvironmentItem` when
        ``item`` lacks what the environment needs."""

    @abstractmethod
    def respond(self, action: str) -> Observation:
        """The answer to a turn without tool calls (:meth:`step` ends the episode at ``max_turns``)."""
