"""The registry of built-in environments, and the way from an operator's spec to a served environment.

:data:`ENVIRONMENTS` is a plain dict: a new environment is a new
:class:`~rlfleet.reward.environments.base.Environment` subclass added here. A spec names one and
its options, in the reward specs' text form (``calculator:max_turns=6,tools=calculator|python``;
values read as :func:`~rlfleet.reward.spec.parse_value` reads them) or as a dict
(``{"name": "calculator", "args": {"max_turns": 6}}``). :func:`build_environment` checks the
name, every option and every tool when the reward worker starts, so a mistake stops it before it
serves anything (:class:`~rlfleet.reward.errors.EnvironmentSpecError`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rlfleet.common.schema.reward import EnvironmentConfig, Spec
from rlfleet.reward.environments.base import Environment
from rlfleet.reward.environments.calculator import Calculator
from rlfleet.reward.environments.guess_number import GuessNumber
from rlfleet.reward.environments.tools import Tool, make_tools
from rlfleet.reward.errors import EnvironmentSpecError, RewardSpecError
from rlfleet.reward.spec import parse_args

logger = logging.getLogger(__name__)

ENVIRONMENTS: dict[str, type[Environment]] = {
    "calculator": Calculator,
    "guess_number": GuessNumber,
}


@dataclass(frozen=True)
class ConfiguredEnvironment:
    """An environment the operator configured: its name, kind, checked options, tools and step deadline."""

    name: str
    kind: type[Environment]
    options: Mapping[str, Any]
    tools: Mapping[str, Tool]
    step_s: float

    def new(self) -> Environment:
        """A fresh episode's environment (its own state; the tools are shared)."""
        env = self.kind.model_validate(dict(self.options))
        env.equip(self.tools)
        return env


def parse_environment_spec(name: str, spec: Spec) -> tuple[type[Environment], dict[str, Any]]:
    """The environment class ``spec`` names and its options (unchecked), for the endpoint ``name``."""
    if isinstance(spec, str):
        kind, _, argtext = spec.strip().partition(":")
        try:
            args: dict[str, Any] = dict(parse_args(argtext, name=kind, spec=spec))
        except RewardSpecError as exc:
            raise EnvironmentSpecError(name, spec, exc.reason) from None
    elif isinstance(spec, Mapping):
        extra = sorted(set(spec) - {"name", "args"})
        if "name" not in spec or extra or not isinstance(spec.get("args", {}), Mapping):
            raise EnvironmentSpecError(
                name, spec, "the dict form is {name: <environment>, args: {option: value}}"
            )
        kind, args = str(spec["name"]), dict(spec.get("args", {}))
    else:
        raise EnvironmentSpecError(name, spec, f"expected a str or a dict, got {type(spec).__name__}")
    if kind not in ENVIRONMENTS:
        raise EnvironmentSpecError(name, spec, f"unknown environment {kind!r}; built-in environments are "
                                               f"{sorted(ENVIRONMENTS)}")  # fmt: skip
    return ENVIRONMENTS[kind], args


def build_environment(name: str, config: EnvironmentConfig) -> ConfiguredEnvironment:
    """Check ``config``'s spec (the environment, every option, every tool) and build its tools."""
    kind, args = parse_environment_spec(name, config.environment)
    try:
        options = kind.model_validate(args)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            reason = (
                f"{kind.kind} takes no option {where!r} (it takes: {', '.join(sorted(kind.model_fields))})"
            )
        else:
            reason = f"option {where}: {err['msg']}" if where else err["msg"]
        raise EnvironmentSpecError(name, config.environment, reason) from None
    tools = make_tools(options.tools, config.sandbox)
    checked = options.model_dump(mode="json")
    logger.info("environment %s: %s %s", name, kind.kind, checked)
    return ConfiguredEnvironment(name, kind, checked, tools, config.step_s)
