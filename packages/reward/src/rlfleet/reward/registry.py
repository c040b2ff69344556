"""The registries of built-in rewards, and the way from a spec (text or dict) to a :class:`CompositeReward`.

:data:`RULES` and :data:`MODELS` are plain dicts: a new rule is a new
:class:`~rlfleet.reward.base.Rule` subclass added here, a new model-backed reward a new
:class:`~rlfleet.reward.base.ModelComponent`. :func:`parse_reward_spec` checks syntax and names;
:func:`build_reward` also validates every option, imports user functions and loads models, so
every spec mistake surfaces before the first sample is scored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from rlfleet.reward.answers import ExactMatch, Numeric
from rlfleet.reward.base import BatchRewardFn, ModelComponent, RewardFn, Rule
from rlfleet.reward.composite import Component, CompositeReward
from rlfleet.reward.errors import (
    BadRewardArgument,
    RewardSpecError,
    UnknownReward,
    UnknownRewardArgument,
)
from rlfleet.reward.relevance import Relevance
from rlfleet.reward.reward_model import RewardModel
from rlfleet.reward.rules import Charset, Concise, Episode, Keyword, LengthPenalty, Regex
from rlfleet.reward.similarity import Similarity
from rlfleet.reward.spec import ComponentSpec, RewardSpec, parse_spec_text
from rlfleet.reward.user import UserFunction

logger = logging.getLogger(__name__)

RuleFactory = type[Rule]
"""A rule class: called with the rule's options, it returns a :class:`RewardFn`."""

RULES: dict[str, RuleFactory] = {
    "concise": Concise,
    "length_penalty": LengthPenalty,
    "keyword": Keyword,
    "regex": Regex,
    "charset": Charset,
    "numeric": Numeric,
    "exact_match": ExactMatch,
    "relevance": Relevance,
    "episode": Episode,
}

MODELS: dict[str, type[ModelComponent]] = {
    "rm": RewardModel,
    "similarity": Similarity,
}
"""Model-backed components: scored a batch at a time; their models load when the spec is built."""

BUILTINS: dict[str, type[Rule] | type[ModelComponent]] = {**RULES, **MODELS}
"""Every built-in name a spec may use."""

MODEL_PATH_OPTIONS: dict[str, str] = {"rm": "path", "similarity": "model"}
"""The option of each model component that names the directory its model loads from."""


def model_paths(spec: RewardSpec) -> list[str]:
    """The model directories ``spec`` names (an option left at its default, e.g. ``minilm``, is a
    built-in model and names none)."""
    paths = []
    for comp in spec.components:
        option = MODEL_PATH_OPTIONS.get(comp.name)
        if option is None or option not in comp.args:
            continue
        if comp.args[option] != MODELS[comp.name].model_fields[option].default:
            paths.append(str(comp.args[option]))
    return paths


def parse_reward_spec(
    spec: str | Mapping[str, Any] | RewardSpec, *, revision: int | None = None
) -> RewardSpec:
    """Parse the text or dict form of a spec (see :mod:`rlfleet.reward.spec`) into a :class:`RewardSpec`.

    ``revision`` overrides the spec's own (the text form has none: 0). Raises
    :class:`RewardSpecError` for bad syntax and :class:`UnknownReward` for an unknown rule name.
    """
    if isinstance(spec, RewardSpec):
        parsed = spec
    elif isinstance(spec, str):
        parsed = parse_spec_text(spec, is_rule=BUILTINS.__contains__, known=list(BUILTINS))
    elif isinstance(spec, Mapping):
        try:
            parsed = RewardSpec.model_validate(dict(spec))
        except ValidationError as exc:
            raise RewardSpecError(spec, _first_error(exc)) from exc
    else:
        raise RewardSpecError(spec, f"expected a str or a dict, got {type(spec).__name__}")
    for comp in parsed.components:
        if not comp.is_user_function and comp.name not in BUILTINS:
            raise UnknownReward(comp.name, BUILTINS)
    if revision is not None:
        parsed = parsed.model_copy(update={"revision": revision})
    return parsed


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]


def build_rule(name: str, args: Mapping[str, Any]) -> Rule | ModelComponent:
    """Validate the options of the built-in ``name`` (a rule, or a model component's options).

    Errors name the reward and the argument. A model component is returned unloaded.
    """
    if name not in BUILTINS:
        raise UnknownReward(name, BUILTINS)
    factory = BUILTINS[name]
    try:
        return factory(**args)
    except ValidationError as exc:
        err = exc.errors()[0]
        arg = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            raise UnknownRewardArgument(name, arg, factory.model_fields) from exc
        if err["type"] == "missing":
            raise BadRewardArgument(name, arg, missing=True) from exc
        raise BadRewardArgument(name, arg, args.get(arg) if arg else dict(args), err["msg"]) from exc


def _labels(components: list[ComponentSpec]) -> list[str]:
    """Each component's label; repeated names without a label get ``name#1``, ``name#2``..."""
    counts: dict[str, int] = {}
    for c in components:
        counts[c.name] = counts.get(c.name, 0) + 1
    seen: dict[str, int] = {}
    labels = []
    for c in components:
        seen[c.name] = seen.get(c.name, 0) + 1
        default = c.name if counts[c.name] == 1 else f"{c.name}#{seen[c.name]}"
        labels.append(c.label or default)
    if len(set(labels)) != len(labels):
        raise RewardSpecError([c.model_dump() for c in components], f"component labels clash: {labels}")
    return labels


def build_reward(
    spec: str | Mapping[str, Any] | RewardSpec, *, revision: int | None = None
) -> CompositeReward:
    """Parse ``spec``, build every component and return the :class:`CompositeReward`.

    Rule options are validated and filled with their defaults; the filled-in spec is what the
    reward's ``version`` hashes, so ``"concise"`` and ``"concise:max_words=50"`` share a version.
    """
    parsed = parse_reward_spec(spec, revision=revision)
    components: list[Component] = []
    normalized: list[ComponentSpec] = []
    for comp, label in zip(parsed.components, _labels(parsed.components), strict=True):
        fn: RewardFn | BatchRewardFn
        if comp.is_user_function:
            fn = UserFunction.load(comp.name, comp.args)
            args = dict(comp.args)
        else:
            options = build_rule(comp.name, comp.args)
            if isinstance(options, ModelComponent):  # None options (defaults) stay out: no text form
                fn, args = options.load(), options.model_dump(mode="json", exclude_none=True)
            else:
                fn, args = options, options.model_dump(mode="json")
        components.append(Component(label=label, weight=comp.weight, fn=fn))
        normalized.append(comp.model_copy(update={"args": args}))
    reward = CompositeReward(components, parsed.model_copy(update={"components": normalized}))
    logger.debug("built reward %s (version %s)", reward.spec, reward.version)
    return reward
