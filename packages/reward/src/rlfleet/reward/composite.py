"""A built reward: weighted components scored over a batch, each component reported on its own.

``total[i] = sum(weight_c * score_c[i])``; ``components[label_c]`` holds the unweighted
``score_c``. A rule or user function scores one sample per call; a model component
(:class:`~rlfleet.reward.base.BatchRewardFn`) scores the whole batch in one call. Every score is
checked to be a finite number; a component that raises or returns anything else stops the batch
with a :class:`RewardFunctionError` naming the component and the sample, never with a silent zero.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlfleet.reward.base import BatchRewardFn, RewardFn
from rlfleet.reward.errors import RewardFunctionError, RewardInputError
from rlfleet.reward.spec import RewardSpec

logger = logging.getLogger(__name__)


class ScoreBatch(BaseModel):
    """Scores of a batch of N samples."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    total: list[float] = Field(description="(N,) weighted sum of the components")
    components: dict[str, list[float]] = Field(description="label -> (N,) unweighted component scores")
    version: str = Field(description="the reward's version (RewardSpec.version of the normalized spec)")

    @model_validator(mode="after")
    def _same_length(self) -> ScoreBatch:
        for label, scores in self.components.items():
            if len(scores) != len(self.total):
                raise ValueError(
                    f"component {label!r} has {len(scores)} scores for {len(self.total)} samples"
                )
        return self


@dataclass(frozen=True)
class Component:
    """One resolved component: its report label, its weight and the function that scores it."""

    label: str
    weight: float
    fn: RewardFn | BatchRewardFn


def _checked(value: object, label: str, index: int) -> float:
    if not isinstance(value, numbers.Real):
        raise RewardFunctionError(label, index, f"returned {value!r} ({type(value).__name__}), not a number")
    result = float(value)
    if not math.isfinite(result):
        raise RewardFunctionError(label, index, f"returned {result}, not a finite number")
    return result


class CompositeReward:
    """The reward a spec describes; build it with :func:`rlfleet.reward.registry.build_reward`.

    ``spec`` is the normalized spec (every rule option filled in), so ``version`` changes exactly
    when what the reward computes changes (or when the spec's revision is bumped).
    """

    def __init__(self, components: Sequence[Component], spec: RewardSpec) -> None:
        labels = [c.label for c in components]
        if len(set(labels)) != len(labels):
            raise ValueError(f"component labels must be unique, got {labels}")
        self.components = tuple(components)
        self.spec = spec
        self.version = spec.version

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        metadata_list: Sequence[Mapping[str, Any]] | None = None,
    ) -> ScoreBatch:
        """Score N samples: ``prompts``, ``responses`` and ``metadata_list`` are (N,) and aligned."""
        n = len(responses)
        if len(prompts) != n:
            raise RewardInputError(f"{len(prompts)} prompts for {n} responses; pass one prompt per response")
        if metadata_list is None:
            metadata_list = [{}] * n
        elif len(metadata_list) != n:
            raise RewardInputError(f"{len(metadata_list)} metadata entries for {n} responses")
        per_component: dict[str, list[float]] = {}
        total = [0.0] * n
        for comp in self.components:
            if isinstance(comp.fn, BatchRewardFn):
                scores = self._score_batch(comp, comp.fn, prompts, responses, metadata_list)
            else:
                scores = [
                    self._score_one(comp, i, prompts[i], responses[i], metadata_list[i]) for i in range(n)
                ]
            per_component[comp.label] = scores
            for i, s in enumerate(scores):
                total[i] += comp.weight * s
        return ScoreBatch(total=total, components=per_component, version=self.version)

    __call__ = score

    @staticmethod
    def _score_batch(
        comp: Component,
        fn: BatchRewardFn,
        prompts: Sequence[str],
        responses: Sequence[str],
        metadata_list: Sequence[Mapping[str, Any]],
    ) -> list[float]:
        if not responses:
            return []
        try:
            values = list(fn.score_batch(prompts, responses, metadata_list))
        except Exception as exc:  # any failure of a model component: re-raised with the component named
            raise RewardFunctionError(comp.label, None, f"{type(exc).__name__}: {exc}") from exc
        if len(values) != len(responses):
            raise RewardFunctionError(comp.label, None, f"{len(values)} scores for {len(responses)} samples")
        return [_checked(v, comp.label, i) for i, v in enumerate(values)]

    @staticmethod
    def _score_one(
        comp: Component, index: int, prompt: str, response: str, metadata: Mapping[str, Any]
    ) -> float:
        try:
            value = comp.fn(prompt, response, **metadata)
        except Exception as exc:  # any failure of user code: re-raised with the component and sample
            raise RewardFunctionError(comp.label, index, f"{type(exc).__name__}: {exc}") from exc
        return _checked(value, comp.label, index)

    def score_one(self, prompt: str, response: str, /, **metadata: Any) -> float:
        """The total reward of one sample; makes a CompositeReward a :class:`RewardFn` too."""
        return self.score([prompt], [response], [metadata]).total[0]

    def __rlfleet_reward__(self) -> dict[str, Any]:
        """What a controller sends to a reward server to serve this reward (``SetRewardSpec`` fields)."""
        return {"spec": self.spec.model_dump(mode="json", exclude={"revision"})}

    def __repr__(self) -> str:
        return f"CompositeReward({str(self.spec)!r}, version={self.version!r})"
