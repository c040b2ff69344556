"""The tools an environment lets the model call, and what one turn's calls come to.

:data:`TOOLS` names the built-in tools: ``calculator`` (safe arithmetic,
:mod:`rlfleet.reward.environments.arithmetic`) and ``python`` (the code the model wrote, run in a
:class:`~rlfleet.reward.sandbox.Sandbox`; a server never runs code sent to it in a message). An
environment's operator lists the tools it allows (its ``tools`` option); :func:`make_tools` builds
them once per configured environment.

:func:`run_turn` reads a turn's calls (:func:`~rlfleet.reward.tool_calls.parse_tool_calls`), runs
at most ``max_calls`` of them and returns the observation and the counts that go in ``info``:
``tool_calls`` (calls that reached a tool), ``tool_errors`` (of those, the ones that failed) and
``malformed_calls`` (unreadable, an unknown tool, wrong arguments, past ``max_calls``). Every
failure is text for the model: ``tool call error: ...`` for a call that could not be made,
``tool error: <tool>: ...`` for a tool that failed. One call's result is the observation; several
are numbered ``[1]``, ``[2]``... and separated by a blank line.

:func:`tools_prompt` is the system-prompt text that describes the tools and both call forms, and
:func:`tool_schemas` the same tools as JSON schemas for a chat template's ``tools=``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rlfleet.common.schema.reward import SandboxLimits
from rlfleet.reward.environments.arithmetic import CalculatorTool
from rlfleet.reward.errors import ToolFailed
from rlfleet.reward.sandbox import Sandbox
from rlfleet.reward.tool_calls import (
    CLOSE_TAG,
    OPEN_TAG,
    PLAIN_TOOL,
    MalformedCall,
    ToolCall,
    parse_tool_calls,
)

logger = logging.getLogger(__name__)


class Tool(Protocol):
    """A tool of one string argument; :meth:`run` returns its result or raises :class:`ToolFailed`."""

    name: str
    argument: str
    description: str
    argument_description: str

    def run(self, argument: str, deadline: float | None = None) -> str: ...


class PythonTool:
    """The ``python`` tool: runs the model's code in a sandbox and returns what it printed."""

    name = "python"
    argument = "code"
    description = (
        "Run a Python program (standard library only, no network, limited time and memory) and return "
        "what it prints; print the values you need."
    )
    argument_description = "the program's source code"

    def __init__(self, limits: SandboxLimits) -> None:
        self.sandbox = Sandbox(limits)
        logger.info("python tool: sandbox isolation %s", "+".join(self.sandbox.isolation))
        if os.geteuid() == 0 and "nobody" not in self.sandbox.isolation:
            logger.warning("python tool: this worker runs as root and uid 65534 cannot run its Python: the "
                           "model's code runs as root%s", " in a user namespace" if self.sandbox.isolation[0]
                           == "namespaces" else ", with no namespace around it")  # fmt: skip
        if "namespaces" not in self.sandbox.isolation:
            logger.warning("python tool: no namespaces on this host: the model's code has no network but can "
                           "read what this worker's user can (/proc of its processes included)")  # fmt: skip

    def run(self, argument: str, deadline: float | None = None) -> str:
        result = self.sandbox.run(argument, deadline=deadline)
        if result.ok:
            return result.output or "(no output)"
        output = f"\n{result.output}" if result.output else ""
        raise ToolFailed(self.name, result.problem() + output)


TOOLS: dict[str, Callable[[SandboxLimits], Tool]] = {
    "calculator": lambda _limits: CalculatorTool(),
    "python": PythonTool,
}
"""The built-in tools an environment's ``tools`` option may name: each built from the environment's
sandbox limits (which only ``python`` uses)."""


def make_tools(names: Iterable[str], limits: SandboxLimits) -> dict[str, Tool]:
    """The tools ``names`` (of :data:`TOOLS`); the sandbox starts (and probes its isolation) only for
    ``python``."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; tools are {sorted(TOOLS)}")
    return {name: TOOLS[name](limits) for name in names}


@dataclass(frozen=True)
class ToolTurn:
    """What a turn's tool calls came to: the observation text and the counts."""

    called: bool
    """The turn held at least one call (readable or not): it is a tool turn, not an answer."""
    text: str = ""
    tool_calls: int = 0
    tool_errors: int = 0
    malformed_calls: int = 0

    def info(self) -> dict[str, float]:
        return {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "malformed_calls": self.malformed_calls}  # fmt: skip


def run_turn(
    action: str, tools: Mapping[str, Tool], max_calls: int, deadline: float | None = None
) -> ToolTurn:
    """Run the calls of ``action`` (a model's turn) on ``tools``: at most ``max_calls``, in order."""
    calls = parse_tool_calls(action)
    if not calls:
        return ToolTurn(called=False)
    results: list[str] = []
    made = errors = malformed = 0
    for call in calls[:max_calls]:
        problem = _problem(call, tools)
        if problem:
            malformed += 1
            results.append(f"tool call error: {problem}")
            continue
        assert isinstance(call, ToolCall)
        tool = tools[call.name]
        made += 1
        try:
            results.append(tool.run(str(call.arguments[tool.argument]), deadline).rstrip("\n"))
        except ToolFailed as exc:
            errors += 1
            results.append(f"tool error: {exc}")
    if len(calls) > max_calls:
        skipped = len(calls) - max_calls
        malformed += skipped
        results.append(
            f"tool call error: at most {max_calls} tool calls run per turn; {skipped} more were not run"
        )
    text = results[0] if len(results) == 1 else "\n\n".join(f"[{i}] {r}" for i, r in enumerate(results, 1))
    return ToolTurn(True, text, made, errors, malformed)


def _problem(call: ToolCall | MalformedCall, tools: Mapping[str, Tool]) -> str:
    """Why ``call`` cannot be made ('' when it can)."""
    if isinstance(call, MalformedCall):
        return call.reason
    tool = tools.get(call.name)
    if tool is None:
        return f"unknown tool {call.name!r}; the tools here are {sorted(tools) or 'none'}"
    if tool.argument not in call.arguments:
        return f"the call of {call.name!r} lacks its argument {tool.argument!r}"
    extra = sorted(set(call.arguments) - {tool.argument})
    if extra:
        return f"{call.name!r} takes only the argument {tool.argument!r}, not {extra}"
    value = call.arguments[tool.argument]
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        return f"the argument {tool.argument!r} of {call.name!r} must be a string"
    return ""


def tool_schemas(tools: Mapping[str, Tool]) -> list[dict[str, Any]]:
    """The tools as function schemas (OpenAI / Hugging Face chat templates' ``tools=``)."""
    return [
        {"type": "function", "function": {
            "name": t.name, "description": t.description,
            "parameters": {
                "type": "object", "required": [t.argument],
                "properties": {t.argument: {"type": "string", "description": t.argument_description}},
            },
        }}
        for t in tools.values()
    ]  # fmt: skip


def tools_prompt(tools: Mapping[str, Tool]) -> str:
    """System-prompt text describing ``tools`` and how to call them (for a template without tools)."""
    if not tools:
        return ""
    schemas = "\n".join(json.dumps(s) for s in tool_schemas(tools))
    example = next(iter(tools.values()))
    lines = [
        "You may call tools. Their signatures are within <tools></tools>:",
        f"<tools>\n{schemas}\n</tools>",
        f'To call a tool, write {OPEN_TAG}{{"name": <tool name>, "arguments": {{...}}}}{CLOSE_TAG}, '
        f'e.g. {OPEN_TAG}{{"name": "{example.name}", "arguments": {{"{example.argument}": "..."}}}}'
        f"{CLOSE_TAG}; several calls in one turn run in order.",
    ]
    if PLAIN_TOOL in tools:
        lines.append(f"A line '{PLAIN_TOOL}: <expression>' also calls the {PLAIN_TOOL}.")
    lines.append("Each result comes back in the next turn. When you know the answer, reply without a tool "
                 "call: that reply is your final answer.")  # fmt: skip
    return "\n".join(lines)
