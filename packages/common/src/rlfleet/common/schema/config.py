"""Config base: typed pydantic configs loaded from YAML or TOML with ``a.b.c=value`` overrides.

Every tier's config subclasses :class:`ConfigModel` (unknown fields are errors, assignments are
validated). :func:`load_config` layers a dict, a file and command-line overrides, validates the
result and turns every failure into a :class:`ConfigError` naming the dotted field path and the
bad value. :func:`dump_config` writes the resolved config back as YAML.
"""

from __future__ import annotations

import copy
import difflib
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from rlfleet.common.errors import ConfigError

M = TypeVar("M", bound=BaseModel)

FILE = "<file>"
OVERRIDE = "<override>"


class ConfigModel(BaseModel):
    """Base of rlfleet configs: unknown fields are rejected, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` (no dot) as a float, as people write learning rates."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_config(
    model_cls: type[M],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    data: dict[str, Any] | None = None,
) -> M:
    """Build ``model_cls`` from ``data``, then the file at ``path`` over it, then ``overrides``.

    ``overrides`` are ``dotted.key=value`` strings; values are read as YAML (``3``, ``0.1``,
    ``1e-5``, ``true``, ``[1, 2]``, ``null``; ``x=`` is the empty string) and missing tables are
    created. Raises :class:`ConfigError` for a missing or malformed file, a malformed override,
    an unknown field or a value of the wrong type.
    """
    raw: dict[str, Any] = copy.deepcopy(data) if data else {}
    if path is not None:
        raw = merge(raw, read_config_file(path))
    apply_overrides(raw, overrides)
    try:
        return model_cls.model_validate(raw)
    except ValidationError as exc:
        raise _as_config_error(model_cls, exc) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a ``.yaml`` / ``.yml`` / ``.toml`` file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError(FILE, str(path), "unknown config format; use a .yaml, .yml or .toml file")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(FILE, str(path), "no such config file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(FILE, str(path), f"cannot read it ({exc.__class__.__name__})") from None
    loaded = _parse_toml(path, text) if suffix == ".toml" else _parse_yaml(path, text)
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(FILE, str(path), f"the top level must be a mapping, not a {type(loaded).__name__}")
    return loaded


def _parse_yaml(path: Path, text: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}:{line}", _line(text, line), f"malformed YAML: {problem}") from None


def _parse_toml(path: Path, text: str) -> Any:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"at line (\d+)", str(exc))
        line = int(found.group(1)) if found else 0
        raise ConfigError(f"{path}:{line}", _line(text, line), f"malformed TOML: {exc}") from None


def _line(text: str, line: int) -> str:
    lines = text.splitlines()
    return lines[line - 1].strip() if 0 < line <= len(lines) else ""


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` laid on top; nested mappings merge key by key (returns a new dict)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=3"`` -> ``(["a", "b"], 3)``, the value read as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(OVERRIDE, text, "expected KEY=VALUE, e.g. trainer.lr=1e-5")
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(OVERRIDE, text, "the key needs dot-separated names, e.g. trainer.lr=1e-5")
    if not raw.strip():
        return parts, ""
    try:
        return parts, yaml.load(raw, Loader=_Loader)  # _Loader is a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(key, raw, f"not a YAML value ({problem})") from None


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set each ``dotted.key=value`` in ``data`` (in place, creating tables) and return it."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    for text in overrides:
        parts, value = parse_override(text)
        table = data
        for i, part in enumerate(parts[:-1]):
            child = table.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(
                    where, child, f"is not a table, so {text.partition('=')[0]!r} cannot be set"
                )
            table = child
        table[parts[-1]] = value
    return data


def dump_config(model: BaseModel) -> str:
    """The config as YAML, in field order, which :func:`load_config` reads back to an equal model."""
    return yaml.safe_dump(model.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def _as_config_error(model_cls: type[BaseModel], exc: ValidationError) -> ConfigError:
    errors = exc.errors()
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    where = _dotted(loc) or "<root>"
    if first["type"] == "extra_forbidden":
        reason = "unknown field" + _suggest(model_cls, loc)
    else:
        reason = first["msg"]
    if len(errors) > 1:
        others = ", ".join(_dotted(tuple(e.get("loc", ()))) or "<root>" for e in errors[1:4])
        reason += f" (and {len(errors) - 1} more problem(s): {others}{', ...' if len(errors) > 4 else ''})"
    return ConfigError(where, _redact(loc, first.get("input")), reason)


SECRET_FIELDS = frozenset({"password", "token", "reward_token"})
"""Settings whose values an error message never shows."""


_URL_LOGIN = re.compile(r"(?<=://)[^/@\s]+@")
"""The user info of a URL (``nats://user:pass@host``), which a dumped error never shows."""


def _redact(loc: tuple[int | str, ...], value: Any) -> Any:
    """``value`` with credentials replaced by ``'***'``: a secret field's value, or such keys of a
    table, and the login in any URL."""
    if loc and loc[-1] in SECRET_FIELDS:
        return "***"
    if isinstance(value, dict):
        return {k: "***" if k in SECRET_FIELDS else _redact((), v) for k, v in value.items()}
    return _URL_LOGIN.sub("***@", value) if isinstance(value, str) else value


def _dotted(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _suggest(model_cls: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """``"; did you mean 'lr'? known fields: ..."`` for an unknown field at ``loc``, when findable."""
    owner: Any = model_cls
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = owner.model_fields.get(part) if _is_model(owner) else None
        owner = _find_model(field.annotation) if field is not None else None
        if owner is None:
            return ""
    if not _is_model(owner):
        return ""
    known = list(owner.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} known fields: {', '.join(known)}"


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _find_model(annotation: Any) -> type[BaseModel] | None:
    if _is_model(annotation):
        return annotation
    for arg in get_args(annotation):
        found = _find_model(arg)
        if found is not None:
            return found
    return None
