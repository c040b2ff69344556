"""The ``calculator`` environment: a question with a numeric answer, and a calculator to work it out.

The dataset item holds the reference under ``answer`` (a number, or a text holding one, read as
the ``numeric`` reward reads it; ``answer_key`` renames it); the question itself is the prompt. The
model may call its tools (``calculator`` by default; the operator may allow ``python``) as often as
it likes: each call's result is the next turn (role ``tool``). A turn without a tool call is the
final answer: reward 1.0 when its number (:func:`~rlfleet.reward.answers.extract_number`: the one
after the last ``####``, else the last one) is within ``tolerance`` of the reference, else 0.0;
the episode is done either way. At ``max_turns`` turns it is done with reward 0.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, PrivateAttr

from rlfleet.reward.answers import extract_number, reference_number
from rlfleet.reward.environments.base import Environment, Observation
from rlfleet.reward.errors import BadEnvironmentItem, RewardInputError

logger = logging.getLogger(__name__)


class Calculator(Environment):
    """See the module docstring."""

    kind: ClassVar[str] = "calculator"

    tools: tuple[str, ...] = Field(default=("calculator",), description="tools the model may call, or 'a|b'")
    answer_key: str = Field(default="answer", min_length=1, description="item field holding the reference")
    tolerance: float = Field(default=1e-6, ge=0, allow_inf_nan=False, description="absolute tolerance")
    _answer: float = PrivateAttr(default=math.nan)

    def begin(self, item: Mapping[str, Any], seed: int) -> Observation:
        try:
            self._answer = reference_number(
                item, self.answer_key, who="the calculator environment", where="item"
            )
        except RewardInputError as exc:
            raise BadEnvironmentItem(self.kind, exc.reason) from None
        return Observation()

    def respond(self, action: str) -> Observation:
        got = extract_number(action)
        right = got is not None and math.isclose(got, self._answer, rel_tol=0.0, abs_tol=self.tolerance)
        return Observation(reward=1.0 if right else 0.0, done=True)
