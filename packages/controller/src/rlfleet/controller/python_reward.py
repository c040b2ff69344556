"""A reward written as plain Python: how the controller calls it, and what it must give back.

``GRPOTrainer(reward=fn)`` and ``trainer.set_reward_fn(fn)`` take any Python callable: a function,
a lambda, a closure, a ``functools.partial``, an object with ``__call__``, a bound method such as
``RewardScaler.compute_reward``. The run calls it in the controller's own process
(:mod:`rlfleet.controller.python_scorer`), as TRL calls its reward functions; nothing is pickled
or sent. How it is called is read from its signature (``inspect.signature``), in this order:

======================================================  ==============================================
signature                                               called as
======================================================  ==============================================
a parameter named ``completions`` (TRL's)               once per chunk, by keyword:
                                                        ``fn(prompts=[...], completions=[...], **cols)``
a parameter named ``responses``, or a first parameter   once per chunk, positionally:
named ``prompts`` (``RewardScaler.compute_reward``)     ``fn(prompts, responses, **cols)``
one positional parameter (``lambda text: ...``)         per sample: ``fn(response)``
two or more (``fn(prompt, response, **metadata)``)      per sample: ``fn(prompt, response, **metadata)``
======================================================  ==============================================

Positional parameters with defaults count only when no parameter lacks one. ``metadata`` is the
dataset row's fields other than the prompt; a function without ``**kwargs`` gets only the fields
it names, so ``def score(prompt, response, answer)`` works on rows that carry more. The batched
forms get each field as a list (``cols``: ``answer=[...]``, ``None`` where a row lacks it): TRL's
form every field its ``**kwargs`` takes, as TRL passes dataset columns; the positional form only
the fields it names (its ``**kw``, as ``compute_reward``'s, may pass on to a scorer that takes
none). A per-sample call returns a number (``bool`` counts as 0/1); a batched call a sequence of
one number per response. Anything else, a NaN or an infinity, or an exception of the function is
a :class:`~rlfleet.controller.errors.RewardFnFailed` naming the function.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from rlfleet.controller.errors import RewardFnFailed

Style = Literal["trl", "batch", "text", "sample"]
"""How a function is called (see the module docstring's table)."""

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def function_name(fn: Any) -> str:
    """``module.qualname`` of ``fn`` (a partial, a bound method and a callable object included)."""
    target = getattr(fn, "func", fn)  # functools.partial
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None) or type(target).__module__
    return f"{module}.{qualname}"


def is_python_reward(fn: Any) -> bool:
    """Whether ``fn`` is a callable run in this process: not a spec, and not an object that
    describes itself to a reward server (``__rlfleet_reward__``: ``CompositeReward``, ``RewardScaler``,
    their bound methods), which goes to the reward tier as its spec."""
    if isinstance(fn, str | bytes | Mapping) or not callable(fn):
        return False
    return not any(hasattr(c, "__rlfleet_reward__") for c in (fn, getattr(fn, "__self__", None)))


class PythonReward:
    """A user's reward callable, its calling style read once from its signature."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        if not callable(fn):
            raise RewardFnFailed(repr(fn), f"a {type(fn).__name__} is not callable")
        self.fn = fn
        self.name = function_name(fn)
        self.style: Style = "sample"
        self.accepts: frozenset[str] | None = None  # None: takes **kwargs, gets every metadata field
        self.takes_prompts = True  # TRL style: whether prompts= is passed
        self._read_signature()

    @property
    def description(self) -> str:
        """What the run's config, checkpoints and statistics show for this reward (it is not a spec)."""
        return f"<python function {self.name}>"

    def _read_signature(self) -> None:
        try:
            params = list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: (prompt, response)
            return
        names = {p.name for p in params}
        positional = [p for p in params if p.kind in _POSITIONAL]
        required = [p for p in positional if p.default is inspect.Parameter.empty] or positional
        if "completions" in names:
            self.style, taken = "trl", {"prompts", "completions"}
        elif "responses" in names or (positional and positional[0].name == "prompts"):
            self.style, taken = "batch", {p.name for p in positional[:2]}
        elif len(required) == 1 and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
            self.style, taken = "text", {required[0].name}
        else:
            self.style, taken = "sample", {p.name for p in positional[:2]}
        if self.style == "batch" or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            self.accepts = frozenset(p.name for p in params if p.kind in _NAMED and p.name not in taken)
            self.takes_prompts = "prompts" in names

    def _fields(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        if self.accepts is None:
            return dict(metadata)
        return {k: v for k, v in metadata.items() if k in self.accepts}

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        """Scores of ``responses`` (N,), each a finite float, or :class:`RewardFnFailed`."""
        if self.style in ("trl", "batch"):
            return self._batched(list(prompts), list(responses), metadata)
        scores = []
        for i, (prompt, response, meta) in enumerate(zip(prompts, responses, metadata, strict=True)):
            try:
                if self.style == "text":
                    value = self.fn(response)
                else:
                    value = self.fn(prompt, response, **self._fields(meta))
            except Exception as exc:  # noqa: BLE001 - the user's code: any error becomes a named one
                raise RewardFnFailed(self.name, f"raised {type(exc).__name__}: {exc} (sample {i})") from exc
            scores.append(self.number(value, i))
        return scores

    def _batched(
        self, prompts: list[str], responses: list[str], metadata: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        keys = list(dict.fromkeys(k for meta in metadata for k in meta))
        columns = self._fields({k: [meta.get(k) for meta in metadata] for k in keys})
        try:
            if self.style == "trl":
                given = {"prompts": prompts} if self.takes_prompts else {}
                values = self.fn(**given, completions=responses, **columns)
            else:
                values = self.fn(prompts, responses, **columns)
        except Exception as exc:  # noqa: BLE001 - the user's code: any error becomes a named one
            raise RewardFnFailed(self.name, f"raised {type(exc).__name__}: {exc}") from exc
        if isinstance(values, str | bytes | Mapping) or not hasattr(values, "__len__"):
            raise RewardFnFailed(self.name, f"returned a {type(values).__name__}; a batched reward function "
                                 f"returns a list of {len(responses)} numbers")  # fmt: skip
        if len(values) != len(responses):
            raise RewardFnFailed(self.name, f"returned {len(values)} scores for {len(responses)} responses")
        return [self.number(value, i) for i, value in enumerate(values)]

    def number(self, value: Any, index: int) -> float:
        """``value`` as a finite float, or :class:`RewardFnFailed` naming the sample."""
        if value is None or isinstance(value, str | bytes):
            raise RewardFnFailed(self.name, f"returned {value!r} for sample {index}; a reward is a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardFnFailed(
                self.name, f"returned a {type(value).__name__} for sample {index}; a reward is a number"
            ) from None
        if not math.isfinite(number):
            raise RewardFnFailed(self.name, f"returned {number} for sample {index}; rewards must be finite")
        return number

    def __repr__(self) -> str:
        return f"PythonReward({self.name}, style={self.style})"
