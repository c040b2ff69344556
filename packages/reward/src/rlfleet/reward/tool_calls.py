"""Tool calls in the text of a model's turn, in the two forms the environments read.

1. Hermes / Qwen: ``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``,
   one or several per turn. ``arguments`` is a JSON object, or a string holding one (some models
   write it so). A last tag left open (a generation stopped at ``</tool_call>``) is read to the
   end of the text.
2. Plain: a line ``calculator: <expression>`` (at the start of a line; the expression runs to the
   end of the line), one call per such line. It is read only when the turn holds no
   ``<tool_call>`` tag, so a turn never mixes the forms.

:func:`parse_tool_calls` returns the calls in the order they appear, each a :class:`ToolCall` or,
when it cannot be read, a :class:`MalformedCall` saying why (the environment answers it with a
``tool call error: ...`` observation). Whether the tool exists and takes those arguments is the
environment's business (:mod:`rlfleet.reward.environments.tools`). A turn with no call in either
form is a plain answer.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
PLAIN_TOOL = "calculator"
"""The one tool the plain form calls (with its ``expression`` argument)."""
MAX_CALLS_READ = 64
"""Calls read from one turn at the most; the rest of the text is not searched."""

_TAGGED = re.compile(re.escape(OPEN_TAG) + r"(.*?)(?:" + re.escape(CLOSE_TAG) + r"|\Z)", re.DOTALL)
_PLAIN = re.compile(rf"^[ \t]*{PLAIN_TOOL}[ \t]*:[ \t]*(.*?)[ \t]*$", re.MULTILINE)


@dataclass(frozen=True)
class ToolCall:
    """A call read from the text: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MalformedCall:
    """Text shaped like a call that cannot be read as one; ``reason`` is said back to the model."""

    reason: str


Call = ToolCall | MalformedCall


def parse_tool_calls(text: str) -> list[Call]:
    """The tool calls of ``text`` (a model's turn), in order; ``[]`` when it holds none."""
    if OPEN_TAG in text:
        return [_tagged(m.group(1)) for m in _TAGGED.finditer(text, 0)][:MAX_CALLS_READ]
    calls: list[Call] = []
    for match in _PLAIN.finditer(text):
        expression = match.group(1)
        if expression:
            calls.append(ToolCall(PLAIN_TOOL, {"expression": expression}))
        else:
            calls.append(MalformedCall(f"'{PLAIN_TOOL}:' is followed by no expression"))
        if len(calls) == MAX_CALLS_READ:
            break
    return calls


def _tagged(body: str) -> Call:
    """One ``<tool_call>`` body: ``{"name": ..., "arguments": {...}}``."""
    body = body.strip()
    if not body:
        return MalformedCall(
            f'an empty {OPEN_TAG}; write {OPEN_TAG}{{"name": ..., "arguments": {{...}}}}{CLOSE_TAG}'
        )
    try:
        call = json.loads(body)
    except ValueError as exc:
        return MalformedCall(f"the {OPEN_TAG} body is not valid JSON ({exc})")
    if not isinstance(call, dict):
        return MalformedCall(f"the {OPEN_TAG} body is a JSON {type(call).__name__}, not an object")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(f'the {OPEN_TAG} object has no "name" (the tool to call)')
    if "arguments" not in call:
        return MalformedCall(f'the call of {name!r} has no "arguments"')
    arguments = call["arguments"]
    if isinstance(arguments, str):  # the arguments as a JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return MalformedCall(f'the "arguments" of {name!r} are a string that is not a JSON object')
    if not isinstance(arguments, dict):
        return MalformedCall(f'the "arguments" of {name!r} must be a JSON object')
    return ToolCall(name, arguments)
