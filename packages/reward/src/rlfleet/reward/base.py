"""What a reward function is: :class:`RewardFn`, :class:`BatchRewardFn`, :class:`Rule`,
:class:`ModelComponent`.

A reward function scores one sample: ``fn(prompt, response, **metadata) -> float``. ``metadata``
holds the sample's extra fields from the dataset (a reference ``answer``, keywords...). A *rule*
is a built-in reward function whose options are a validated pydantic model: ``Concise(max_words=50)``
is a reward function. Rules never read an option from ``metadata``; options are fixed when the rule
is built, so two samples are always scored alike.

A *model component* (a reward model, a sentence encoder) scores a whole batch at once, since a
model runs batched: its options are a pydantic model too, and :meth:`ModelComponent.load` returns
a :class:`BatchRewardFn`.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)


class RewardFn(Protocol):
    """Scores one sample; higher is better."""

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float: ...


@runtime_checkable
class BatchRewardFn(Protocol):
    """Scores N samples at once; higher is better."""

    def score_batch(
        self, prompts: Sequence[str], responses: Sequence[str], metadata_list: Sequence[Mapping[str, Any]]
    ) -> Sequence[float]:
        """(N,) prompts, responses and metadata -> (N,) scores."""
        ...


class ModelComponent(BaseModel):
    """Base of the model-backed components: the fields are the options, :meth:`load` builds the scorer."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, protected_namespaces=())

    @abstractmethod
    def load(self) -> BatchRewardFn:
        """Load the model (shared with other components naming the same one) and return the scorer."""


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
