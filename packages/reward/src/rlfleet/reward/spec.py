"""Reward specs: the typed form (:class:`RewardSpec`) and the text syntax that writes one.

Text form: weighted components joined by ``+``, each ``[weight*]name[:key=value,key=value]``::

    concise:max_words=50
    0.7*concise:max_words=50 + 0.3*relevance
    charset:allowed=0123456789
    numeric + 0.1*mypkg.rewards:my_fn:scale=2

``name`` is a registered rule or a user function ``module:function`` (its arguments follow a
second ``:``). Bare values are read as bool (``true``/``false``), int, float or else str (digits
with a leading zero, like ``0123456789``, stay a str); quote a value (``'...'`` or ``"..."``) to
keep it a string or to put ``+`` ``,`` quotes or spaces at its ends in it:
``regex:pattern='^\\d+$',full=true``. Rules take a number where they want a string (``"123"``).
A negative weight is written ``+ -0.2*name``.

Dict form: ``{"components": [{"name": ..., "weight": ..., "args": {...}, "label": ...}],
"revision": 0}``. This module parses syntax only; which names are rules is given by the caller
(:func:`rlfleet.reward.registry.parse_reward_spec` passes the registry).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlfleet.reward.errors import RewardSpecError, UnknownReward

logger = logging.getLogger(__name__)

ArgScalar = bool | int | float | str | None
ArgValue = ArgScalar | list[ArgScalar]

_IDENT = r"[A-Za-z_]\w*"
_NAME = re.compile(rf"{_IDENT}(?:\.{_IDENT})*(?::{_IDENT})?")
_WEIGHT = re.compile(r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*\*(.*)", re.DOTALL)
# Numbers with a leading zero ("0123456789") stay strings: they are character lists, not numbers.
_INT = re.compile(r"[-+]?(?:0|[1-9]\d*)")
_FLOAT = re.compile(r"[-+]?(?:(?:0|[1-9]\d*)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_QUOTES = "'\""
_NEEDS_QUOTES = re.compile(r"[+,'\"]|^\s|\s$")


class ComponentSpec(BaseModel):
    """One weighted reward component."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="a registered rule name, or a user function 'package.module:function'")
    weight: float = Field(default=1.0, allow_inf_nan=False, description="multiplies the component's score")
    args: dict[str, ArgValue] = Field(default_factory=dict, description="the rule's or function's options")
    label: str | None = Field(default=None, description="key of the component in reports; default: name")

    @field_validator("name")
    @classmethod
    def _name_syntax(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(f"{name!r} is neither a rule name nor 'package.module:function'")
        return name

    @property
    def is_user_function(self) -> bool:
        """True for ``module:function`` names."""
        return ":" in self.name


class RewardSpec(BaseModel):
    """A parsed reward: components summed with their weights, plus an operator-set revision."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    components: list[ComponentSpec] = Field(min_length=1, description="summed, weighted")
    revision: int = Field(
        default=0, ge=0, description="bump when a user function's code changes but the spec does not"
    )

    def canonical(self) -> str:
        """A stable JSON text of what the reward computes (labels and revision left out)."""
        parts = [{"name": c.name, "weight": c.weight, "args": c.args} for c in self.components]
        return json.dumps(parts, sort_keys=True, separators=(",", ":"))

    @property
    def version(self) -> str:
        """``<12 hex digits of sha256(canonical)>-r<revision>``: equal specs give equal versions."""
        digest = hashlib.sha256(self.canonical().encode()).hexdigest()[:12]
        return f"{digest}-r{self.revision}"

    def __str__(self) -> str:
        return format_reward_spec(self)


# --- the text form --------------------------------------------------------------------------


def split_outside_quotes(text: str, sep: str, *, spec: str) -> list[str]:
    """Split ``text`` on ``sep`` where it is not inside a quoted value."""
    parts: list[str] = []
    current: list[str] = []
    quote = ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in _QUOTES:
            quote = char
        elif char == sep:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    if quote:
        raise RewardSpecError(spec, f"unclosed {quote} quote")
    parts.append("".join(current))
    return parts


def parse_value(text: str) -> ArgScalar:
    """A bare value as bool, int, float or str; a quoted one as str without its quotes."""
    text = text.strip()
    if len(text) >= 2 and text[0] in _QUOTES and text[-1] == text[0]:
        return text[1:-1]
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def parse_args(text: str, *, name: str, spec: str) -> dict[str, ArgValue]:
    """``k=v,k=v`` into a dict (keys must be identifiers, each given once)."""
    args: dict[str, ArgValue] = {}
    if not text.strip():
        return args
    for item in split_outside_quotes(text, ",", spec=spec):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise RewardSpecError(spec, f"argument {item.strip()!r} of {name!r} is not key=value")
        if not re.fullmatch(_IDENT, key):
            raise RewardSpecError(spec, f"argument name {key!r} of {name!r} is not an identifier")
        if key in args:
            raise RewardSpecError(spec, f"argument {key!r} of {name!r} is given twice")
        if not raw.strip():
            raise RewardSpecError(spec, f"argument {key!r} of {name!r} has no value (write '' for empty)")
        args[key] = parse_value(raw)
    return args


def parse_component(
    text: str, *, is_rule: Callable[[str], bool], known: list[str], spec: str
) -> ComponentSpec:
    """One ``[weight*]name[:k=v,...]`` component."""
    if not text.strip():
        raise RewardSpecError(spec, "empty component (a stray '+'?)")
    weight = 1.0
    match = _WEIGHT.fullmatch(text)
    if match:
        weight = float(match.group(1))
        text = match.group(2)
    head, _, rest = text.strip().partition(":")
    func, _, after = rest.partition(":")
    if is_rule(head):
        name, argtext = head, rest
    elif rest and re.fullmatch(_IDENT, func.strip()):
        name, argtext = f"{head}:{func.strip()}", after
    else:
        name, argtext = head, rest
    if not _NAME.fullmatch(name):
        raise RewardSpecError(spec, f"{text.strip()!r} is not [weight*]name[:key=value,...]")
    if ":" not in name and not is_rule(name):
        raise UnknownReward(name, known)
    args = parse_args(argtext, name=name, spec=spec)
    return ComponentSpec(name=name, weight=weight, args=args)


def parse_spec_text(spec: str, *, is_rule: Callable[[str], bool], known: list[str]) -> RewardSpec:
    """The text form into a :class:`RewardSpec` (revision 0)."""
    parts = split_outside_quotes(spec, "+", spec=spec)
    components = [parse_component(p, is_rule=is_rule, known=known, spec=spec) for p in parts]
    return RewardSpec(components=components)


# --- back to text ---------------------------------------------------------------------------


def format_value(value: ArgValue) -> str:
    """The text form of one argument value (inverse of :func:`parse_value`)."""
    if isinstance(value, list):
        value = "|".join("" if v is None else str(v) for v in value)
    if value is None:
        raise ValueError("None has no text form; use the dict form of the spec")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if value and not _NEEDS_QUOTES.search(value) and parse_value(value) == value:
        return value
    quote = "'" if "'" not in value else '"'
    if quote in value:
        raise ValueError(f"{value!r} holds both quote characters; use the dict form of the spec")
    return f"{quote}{value}{quote}"


def format_reward_spec(spec: RewardSpec) -> str:
    """The text form of ``spec`` (labels and revision are not part of it)."""
    out = []
    for c in spec.components:
        weight = "" if c.weight == 1.0 else f"{c.weight!r}*"
        args = ",".join(f"{k}={format_value(v)}" for k, v in sorted(c.args.items()))
        out.append(f"{weight}{c.name}" + (f":{args}" if args else ""))
    return " + ".join(out)
