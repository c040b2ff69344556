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

Chat prompts, as TRL: when a prompt was a list of messages (a chat dataset), TRL's form gets that
list as its prompt and ``[{"role": "assistant", "content": response}]`` as its completion; the
other forms keep the texts (the prompt as the model saw it, the response). The run tells the
reward which prompt texts were messages (:attr:`PythonReward.chats`, keyed by the prompt text the
rollout worker decodes, ``skip_special_tokens=True``: :func:`rlfleet.controller.dataset.chat_prompts`).

Several functions with weights, as TRL's ``reward_funcs`` and ``reward_weights``:
:class:`PythonRewards` calls each (each in its own form, above) and scores a response with the
weighted sum; each function's own scores are a component, logged as ``reward/<name>`` (the
function's ``__name__``).
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
    if isinstance(fn, PythonReward):  # already read (a list of functions, PythonRewards)
        return True
    if isinstance(fn, str | bytes | Mapping) or not callable(fn):
        return False
    return not any(hasattr(c, "__rlfleet_reward__") for c in (fn, getattr(fn, "__self__", None)))


Message = dict[str, str]
ChatPrompts = Mapping[str, list[Message]]
"""A prompt text, as the rollout worker decodes it -> the messages it was rendered from."""


def chat_shaped(
    prompts: Sequence[str], responses: Sequence[str], chats: ChatPrompts
) -> tuple[list[Any], list[Any]]:
    """TRL's conversational form: each prompt found in ``chats`` as its messages and its response as
    ``[{"role": "assistant", "content": response}]``; the others as they are."""
    shaped_prompts: list[Any] = []
    completions: list[Any] = []
    for prompt, response in zip(prompts, responses, strict=True):
        messages = chats.get(prompt) if prompt else None
        if messages is None:
            shaped_prompts.append(prompt)
            completions.append(response)
        else:
            shaped_prompts.append([dict(m) for m in messages])  # a copy: the function may change it
            completions.append([{"role": "assistant", "content": response}])
    return shaped_prompts, completions


class PythonReward:
    """A user's reward callable, its calling style read once from its signature."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        if not callable(fn):
            raise RewardFnFailed(repr(fn), f"a {type(fn).__name__} is not callable")
        self.fn = fn
        self.name = function_name(fn)
        self.chats: ChatPrompts = {}
        """Which prompt texts were chat messages (the run sets it; TRL's form gets those as messages)."""
        self.style: Style = "sample"
        self.accepts: frozenset[str] | None = None  # None: takes **kwargs, gets every metadata field
        self.takes_prompts = True  # TRL style: whether prompts= is passed
        self._read_signature()

    def __rlfleet_reward__(self) -> dict[str, Any]:
        """How the run puts this reward in force (``describe_reward_fn``): as itself, scored in this
        process (a reward already read, e.g. :class:`PythonRewards`, is not wrapped again)."""
        return {"python": self}

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

    @property
    def short_name(self) -> str:
        """The function's own name (``__name__``; a partial's function's, an object's class name):
        its component's name in a :class:`PythonRewards`."""
        target = getattr(self.fn, "func", self.fn)
        return getattr(target, "__name__", None) or type(target).__name__

    def scored(
        self, prompts: Sequence[str], responses: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """The scores of ``responses`` and their components (none for one function)."""
        return self(prompts, responses, metadata), {}

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
                shown, completions = chat_shaped(prompts, responses, self.chats)
                given = {"prompts": shown} if self.takes_prompts else {}
                values = self.fn(**given, completions=completions, **columns)
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


RESERVED_COMPONENTS = frozenset({"mean", "std", "max", "min"})
"""Names a component may not take: the step's own ``reward/mean`` ... (``reward/spec_*`` too)."""


def component_names(rewards: Sequence[PythonReward]) -> list[str]:
    """Each function's component name: its ``__name__``; a repeated one numbered (``f``, ``f_2``), one
    that would shadow a step metric (``mean``, ``spec_...``) suffixed ``_fn``."""
    names: list[str] = []
    for reward in rewards:
        base = reward.short_name
        if base in RESERVED_COMPONENTS or base.startswith("spec_") or base == "<lambda>":
            base = "lambda" if base == "<lambda>" else f"{base}_fn"
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return names


class PythonRewards(PythonReward):
    """Several reward functions, each called in its own form, and the weight of each (TRL's
    ``reward_funcs`` and ``reward_weights``; default 1 each): a response's score is the weighted sum
    of theirs, and each function's own (unweighted) scores are its component."""

    def __init__(self, fns: Sequence[Callable[..., Any]], weights: Sequence[float] | None = None) -> None:
        if not fns:
            raise ValueError("a list of reward functions needs at least one")
        self.rewards = [PythonReward(fn) for fn in fns]
        weights = [1.0] * len(self.rewards) if weights is None else [float(w) for w in weights]
        if len(weights) != len(self.rewards):
            raise ValueError(
                f"{len(weights)} reward weights for {len(self.rewards)} reward functions; "
                "give one weight each"
            )
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward weights must be finite numbers, got {weights}")
        self.weights = weights
        self.names = component_names(self.rewards)
        self.fn = self.rewards[0].fn
        self.name = " + ".join(
            r.name if w == 1.0 else f"{w:g}*{r.name}" for r, w in zip(self.rewards, weights, strict=True)
        )
        self.style = "batch"
        self.accepts = None
        self.takes_prompts = True
        self._chats: ChatPrompts = {}

    @property  # type: ignore[override]
    def chats(self) -> ChatPrompts:
        return self._chats

    @chats.setter
    def chats(self, chats: ChatPrompts) -> None:
        self._chats = chats
        for reward in self.rewards:
            reward.chats = chats

    def scored(
        self, prompts: Sequence[str], responses: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """The weighted sums, and each function's own scores under its name."""
        components = {name: reward(prompts, responses, metadata)
                      for name, reward in zip(self.names, self.rewards, strict=True)}  # fmt: skip
        totals = [0.0] * len(responses)
        for weight, scores in zip(self.weights, components.values(), strict=True):
            totals = [t + weight * s for t, s in zip(totals, scores, strict=True)]
        return totals, components

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        return self.scored(prompts, responses, metadata)[0]

    def __repr__(self) -> str:
        return f"PythonRewards({', '.join(self.names)}; weights {self.weights})"


def reward_of(reward: Any, weights: Sequence[float] | None = None) -> Any:
    """A run's reward from what a user gives (``GRPOTrainer(reward=...)``): a list or tuple of reward
    functions becomes a :class:`PythonRewards`, weighted by ``weights`` (TRL's ``reward_funcs`` and
    ``reward_weights``); a list of specs one spec text ``'w1*spec1 + w2*spec2'`` (each entry one
    component, scored by the reward tier, whose components are logged as ``reward/<name>``); anything
    else stays as it is (``weights`` then is an error: there is one reward)."""
    if not isinstance(reward, list | tuple):
        if weights is not None:
            raise ValueError("reward weights (reward.weights, reward_weights) need a list of rewards")
        return reward
    entries = list(reward)
    if entries and all(callable(entry) for entry in entries):
        return PythonRewards(entries, weights)
    if entries and all(isinstance(entry, str) for entry in entries):
        return spec_sum(entries, weights)
    kinds = sorted({"function" if callable(e) else type(e).__name__ for e in entries})
    raise ValueError(
        f"a list of rewards holds functions (scored in the controller) or spec strings (scored by the reward "
        f"tier), not a mix: got {', '.join(kinds) or 'nothing'}; write specs as one spec string "
        "('mymod:fn + 0.5*concise') when the functions live in a module"
    )


def run_weights(given: Sequence[float] | None, configured: Sequence[float] | None) -> list[float] | None:
    """The reward weights of a run: ``reward_weights=`` or the config's ``reward.weights`` (both: the
    same, or an error)."""
    if given is not None and configured is not None and list(map(float, given)) != list(configured):
        raise ValueError(f"reward_weights={list(given)} differs from the config's reward.weights="
                         f"{list(configured)}; set one of them")  # fmt: skip
    chosen = given if given is not None else configured
    return None if chosen is None else [float(w) for w in chosen]


def spec_sum(specs: Sequence[str], weights: Sequence[float] | None) -> str:
    """``['a', 'b:x=1']`` with weights ``[1, 0.5]`` as the spec text ``'1*a + 0.5*b:x=1'``."""
    weights = [1.0] * len(specs) if weights is None else [float(w) for w in weights]
    if len(weights) != len(specs):
        raise ValueError(f"{len(weights)} reward weights for {len(specs)} rewards; give one weight each")
    for spec in specs:
        if "+" in spec or "*" in spec.partition(":")[0] or not spec.strip():
            raise ValueError(
                f"reward list entry {spec!r}: each entry is one component (a rule or 'module:function' with "
                "its options); a weighted sum is written as one spec string, not a list entry"
            )
    return " + ".join(f"{w!r}*{spec.strip()}" for w, spec in zip(weights, specs, strict=True))
