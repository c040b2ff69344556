"""What a reward function is: the :class:`RewardFn` protocol and the :class:`Rule` base class.

A reward function scores one sample: ``fn(prompt, response, **metadata) -> float``. ``metadata``
holds the sample's extra fields from the dataset (a reference ``answer``, keywords...). A *rule*
is a built-in reward function whose options are a validated pydantic model: ``Concise(max_words=50)``
is a reward function. Rules never read an option from ``metadata``; options are fixed when the rule
is built, so two samples are always scored alike.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)


class RewardFn(Protocol):
    """Scores one sample; higher is better."""

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float: ...


class Rule(BaseModel):
    """Base of the built-in rules: the fields are the rule's options, ``__call__`` scores a sample.

    Subclasses inherit ``model_config`` (unknown options are refused, instances are frozen, a
    number given for a str option becomes its text) and implement :meth:`__call__`.
    """

    # coerce_numbers_to_str: the text form reads "allowed=123" as an int; a str option takes it.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, coerce_numbers_to_str=True)

    @abstractmethod
    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float:
        """Score one sample."""


def word_count(text: str) -> int:
    """Number of whitespace-separated words in ``text``."""
    return len(text.split())
