"""Environments: multi-turn, tool-using episodes that reward workers serve to rollout workers.

:class:`Environment` (one episode's state under its options), :class:`Observation` (its answer
to a reset or a step), :data:`ENVIRONMENTS` (the built-ins: ``calculator``, ``guess_number``) and
:func:`build_environment` (an operator's :class:`~rlfleet.common.schema.reward.EnvironmentConfig`
to a :class:`ConfiguredEnvironment`); :data:`TOOLS` and :func:`tools_prompt` for the tools.
:class:`EnvironmentHost` serves them (the reward worker's ``env.*`` requests). See the package
README, "Environments".
"""

from rlfleet.reward.environments.base import Environment, Observation
from rlfleet.reward.environments.host import EnvironmentHost
from rlfleet.reward.environments.registry import (
    ENVIRONMENTS,
    ConfiguredEnvironment,
    build_environment,
    parse_environment_spec,
)
from rlfleet.reward.environments.tools import TOOLS, run_turn, tool_schemas, tools_prompt

__all__ = [
    "ENVIRONMENTS",
    "TOOLS",
    "ConfiguredEnvironment",
    "Environment",
    "EnvironmentHost",
    "Observation",
    "build_environment",
    "parse_environment_spec",
    "run_turn",
    "tool_schemas",
    "tools_prompt",
]
