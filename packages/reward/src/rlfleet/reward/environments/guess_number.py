"""The ``guess_number`` environment: find a secret integer from "higher" / "lower" answers.

The secret is the item's ``secret`` (an integer from ``low`` to ``high``) or, without one, drawn
from ``low..high`` with the reset's ``seed`` (send each episode its own seed). Each turn's guess is
its number (:func:`~rlfleet.reward.answers.extract_number`: the one after the last ``####``, else
the last one); the answer, role ``user``, is ``higher`` (the secret is above the guess), ``lower``
or ``correct``. A turn with no integer is answered with how to guess and counted in ``info`` as
``malformed_calls``. A correct guess at turn ``t`` ends the episode with reward
``max(floor, 1 - discount * (t - 1))`` (1.0 at once, 0.1 less for each turn after, never under
0.5 by default); ``max_turns`` (7) turns without it end the episode with reward 0.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, PrivateAttr, model_validator

from rlfleet.reward.answers import extract_number
from rlfleet.reward.environments.base import Environment, Observation
from rlfleet.reward.errors import BadEnvironmentItem

logger = logging.getLogger(__name__)


class GuessNumber(Environment):
    """See the module docstring."""

    kind: ClassVar[str] = "guess_number"

    max_turns: int = Field(default=7, ge=1, le=100, description="guesses before the episode ends (reward 0)")
    low: int = Field(default=1, description="smallest possible secret")
    high: int = Field(default=100, description="largest possible secret")
    discount: float = Field(
        default=0.1, ge=0, le=1, description="reward lost per turn before the right guess"
    )
    floor: float = Field(default=0.5, ge=0, le=1, description="least reward of a right guess")
    _secret: int = PrivateAttr(default=0)

    @model_validator(mode="after")
    def _range(self) -> GuessNumber:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self

    def begin(self, item: Mapping[str, Any], seed: int) -> Observation:
        secret = item.get("secret")
        if secret is None:
            self._secret = random.Random(seed).randint(self.low, self.high)
        elif isinstance(secret, int) and not isinstance(secret, bool) and self.low <= secret <= self.high:
            self._secret = secret
        else:
            raise BadEnvironmentItem(self.kind, f"item['secret'] = {secret!r} is not an integer from "
                                                f"{self.low} to {self.high}")  # fmt: skip
        return Observation()

    def respond(self, action: str) -> Observation:
        guess = extract_number(action)
        if guess is None or not guess.is_integer():
            text = f"no guess found: answer with an integer from {self.low} to {self.high}"
            return Observation(text, info={"malformed_calls": 1})
        if int(guess) == self._secret:
            reward = max(self.floor, 1.0 - self.discount * (self.turns - 1))
            return Observation("correct", reward=reward, done=True)
        return Observation("higher" if self._secret > guess else "lower")
