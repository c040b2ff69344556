"""RewardScaler: turns raw reward scores into the rewards a trainer sees.

Order of operations, for each raw score ``x`` of a batch::

    x = x / temperature                       # 1. temperature
    x = (x - mean) / (std + eps)              # 2. only with normalize=True (running stats, see below)
    x = min(max(x, -clip), clip)              # 3. only with clip set
    x = max(x, min_reward)                    # 4. only with min_reward set: a floor that always holds

Normalization keeps running statistics of the tempered scores across calls (Welford's algorithm;
population std). A call first folds its batch into the statistics, then normalizes with them, so
the first batch is normalized by its own mean and std. ``update=False`` normalizes with the
statistics as they stand (for evaluation). The statistics are the scaler's own state:
:meth:`RewardScaler.state_dict` / :meth:`RewardScaler.load_state_dict` save and restore them as
plain numbers.

A scaler with a scorer also computes rewards from text: ``compute_reward(prompts, responses, **kw)``.
The scorer is ``fn`` (``RewardScaler(fn=build_reward(spec))`` or ``scaler.wrap(fn)``; any callable
``(prompts, responses, **kw) -> list[float] | ScoreBatch``) or, without ``fn``, the reward model
in the directory ``model_name`` (the ``rm`` component, loaded on first use)::

    scaler = RewardScaler(model_name="/models/my-rm", temperature=0.7, min_reward=0.1)
    rewards = scaler.compute_reward(prompts, responses)

A scaler whose scorer is a spec-built reward (or a ``model_name``) can be sent to a reward server
(``trainer.set_reward_fn(scaler)`` or ``trainer.set_reward_fn(scaler.compute_reward)``): the
server builds the same reward and scaler, statistics included (:meth:`RewardScaler.__rlfleet_reward__`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlfleet.common.schema.reward import ScalerConfig
from rlfleet.reward.composite import ScoreBatch
from rlfleet.reward.errors import NoScorer, NotPortable, RewardInputError

logger = logging.getLogger(__name__)

BatchScorer = Callable[..., Sequence[float] | ScoreBatch]
"""``(prompts, responses, **kw) -> (N,) scores``, e.g. a :class:`CompositeReward`."""


class ScalerState(BaseModel):
    """Running statistics of the tempered scores (Welford): count, mean, sum of squared deviations."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(ge=0, description="scores seen")
    mean: float = Field(allow_inf_nan=False, description="their mean")
    m2: float = Field(ge=0, allow_inf_nan=False, description="sum of squared deviations from the mean")

    @model_validator(mode="after")
    def _consistent(self) -> ScalerState:
        if self.count == 0 and (self.mean != 0 or self.m2 != 0):
            raise ValueError(f"no scores seen (count 0) but mean {self.mean} and m2 {self.m2}")
        if self.count == 1 and self.m2 != 0:
            raise ValueError(f"one score seen but m2 {self.m2} (one score deviates from nothing)")
        return self

    @classmethod
    def empty(cls) -> ScalerState:
        """No scores seen yet."""
        return cls(count=0, mean=0.0, m2=0.0)


class RewardScaler:
    """Temperature, running normalization, clipping and a floor, applied to batches of scores."""

    def __init__(
        self,
        model_name: str | None = None,
        *,
        fn: BatchScorer | None = None,
        temperature: float = 1.0,
        min_reward: float | None = None,
        clip: float | None = None,
        normalize: bool = False,
        eps: float = 1e-6,
    ) -> None:
        self.config = ScalerConfig(
            model_name=model_name,
            temperature=temperature,
            min_reward=min_reward,
            clip=clip,
            normalize=normalize,
            eps=eps,
        )
        self.fn = fn
        self._state = ScalerState.empty()

    @classmethod
    def from_config(cls, config: ScalerConfig, *, fn: BatchScorer | None = None) -> RewardScaler:
        """A scaler with ``config``'s options and fresh statistics."""
        return cls(**config.model_dump(), fn=fn)

    @property
    def model_name(self) -> str | None:
        """The reward model directory scored with when there is no ``fn``."""
        return self.config.model_name

    @property
    def count(self) -> int:
        """How many scores the running statistics have seen."""
        return self._state.count

    @property
    def mean(self) -> float:
        """Running mean of the tempered scores."""
        return self._state.mean

    @property
    def std(self) -> float:
        """Running population std of the tempered scores (0 before two scores)."""
        s = self._state
        return math.sqrt(s.m2 / s.count) if s.count else 0.0

    def _update(self, values: Sequence[float]) -> None:
        """Fold ``values`` into the statistics, all or nothing: the new statistics are computed
        aside and checked whole, so a batch whose scores overflow them (a mean or a sum of squares
        that is no longer finite) raises :class:`RewardInputError` and leaves them as they were."""
        count, mean, m2 = self._state.count, self._state.mean, self._state.m2
        for x in values:
            count += 1
            delta = x - mean
            mean += delta / count
            m2 += delta * (x - mean)
        if not (math.isfinite(mean) and math.isfinite(m2)):
            raise RewardInputError(
                f"this batch of {len(values)} scores would make the running statistics non-finite "
                f"(mean {mean}, m2 {m2}); the statistics are kept as they were"
            )
        self._state = ScalerState(count=count, mean=mean, m2=max(m2, 0.0))

    def __call__(self, scores: Sequence[float], *, update: bool = True) -> list[float]:
        """Scale a batch of raw scores (N,) -> (N,); see the module docstring for the order."""
        values = [float(x) for x in scores]
        for i, x in enumerate(values):
            if not math.isfinite(x):
                raise RewardInputError(f"raw score {i} is {x}; rewards must be finite numbers")
        cfg = self.config
        values = [x / cfg.temperature for x in values]
        if cfg.normalize and values:
            if update:
                self._update(values)
            elif self._state.count == 0:
                raise RewardInputError("no running statistics yet: scale a batch with update=True first")
            mean, denom = self.mean, self.std + cfg.eps
            values = [(x - mean) / denom for x in values]
        if cfg.clip is not None:
            values = [min(max(x, -cfg.clip), cfg.clip) for x in values]
        if cfg.min_reward is not None:
            values = [max(x, cfg.min_reward) for x in values]
        return values

    def compute_reward(self, prompts: Sequence[str], responses: Sequence[str], **kw: Any) -> list[float]:
        """Score with the scorer, then scale: ``self(fn(prompts, responses, **kw))``, (N,) floats.

        ``kw`` goes to the scorer as is (a CompositeReward takes ``metadata_list``).
        """
        if self.fn is None:
            if not self.config.model_name:
                raise NoScorer(self.config.model_name)
            from rlfleet.reward.registry import build_reward

            self.fn = build_reward(self._model_spec(self.config.model_name))
        raw = self.fn(prompts, responses, **kw)
        totals = raw.total if isinstance(raw, ScoreBatch) else list(raw)
        if len(totals) != len(responses):
            raise RewardInputError(f"the scorer returned {len(totals)} scores for {len(responses)} responses")
        return self(totals)

    def wrap(self, fn: BatchScorer) -> RewardScaler:
        """A new scaler with these options and a copy of these statistics, scoring with ``fn``."""
        other = RewardScaler.from_config(self.config, fn=fn)
        other.load_state_dict(self.state_dict())
        return other

    def state_dict(self) -> dict[str, Any]:
        """The running statistics as plain numbers: ``{"count": int, "mean": float, "m2": float}``."""
        return self._state.model_dump()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore statistics saved by :meth:`state_dict`: the whole dict is validated (types,
        finite numbers, consistent with each other) before it replaces the statistics, so a bad one
        raises ValueError and leaves them as they were."""
        self._state = ScalerState.model_validate(dict(state))

    def reset(self) -> None:
        """Forget the running statistics."""
        self._state = ScalerState.empty()

    @staticmethod
    def _model_spec(model_name: str) -> dict[str, Any]:
        return {"components": [{"name": "rm", "args": {"path": model_name}}]}

    def __rlfleet_reward__(self) -> dict[str, Any]:
        """What a controller sends to a reward server to serve this scaler (``SetRewardSpec`` fields).

        Raises :class:`NotPortable` when the scorer is a plain callable: a server can only build
        what a spec describes.
        """
        describe = getattr(self.fn, "__rlfleet_reward__", None)
        if describe is not None:
            spec = describe()["spec"]
        elif self.fn is None and self.config.model_name:
            spec = self._model_spec(self.config.model_name)
        else:
            raise NotPortable(
                "RewardScaler",
                f"its scorer {self.fn!r} is a plain callable; build it with build_reward(spec) "
                "or give model_name=<reward model directory>",
            )  # fmt: skip
        return {
            "spec": spec,
            "scaler": self.config.model_dump(mode="json"),
            "scaler_state": self.state_dict(),
        }

    def __repr__(self) -> str:
        return f"RewardScaler({self.config!r}, count={self.count})"
