"""Config base: typed pydantic configs loaded from YAML or TOML with ``a.b.c=value`` overrides.

Every tier's config subclasses :class:`ConfigModel` (unknown fields are errors, assignments are
validated). :func:`load_config` layers a dict, a file and command-line overrides, validates the
result and turns every failure into a :class:`ConfigError` naming the dotted field path and the
bad value. :func:`dump_config` writes the resolved config back as YAML.

**Sections and the flat form.** Configs nest by owner: a setting lives in the section of the class
that owns it (``update.learning_rate``, ``rollout.engine.colocate``). The flat form of the previous
release (every setting a top-level key, ``learning_rate``, ``eval_data``, ``launcher: ray`` with
``ray_address``) still loads: a class's :meth:`ConfigModel.legacy` table maps each flat key to its
place (every field of a section a class holds, found by itself, plus the renames the class lists
in ``RENAMED``), and :func:`nest_legacy` moves such keys into their sections before validation
(a key set both ways: the flat one wins, as a ``key=value`` override on top of a nested file should).
Where the flat form is deprecated (``WARN_LEGACY``: the job config) a ``FutureWarning`` names each
key's new place, except for the documented short forms (``SHORT``: ``learning_rate=1e-5`` stays a
way to write ``update.learning_rate``). :func:`legacy_dump` writes a model back in the flat form,
for readers of the previous release (worker config files, the step settings on the wire).
A section given as a plain string is its short form (``algorithm: grpo``, ``launcher: ray``,
``rollout.engine: vllm``): the class's ``SHORT_FORM`` field takes it.
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
import tomllib
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar, get_args

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from rlfleet.common.errors import ConfigError

M = TypeVar("M", bound=BaseModel)

FILE = "<file>"
OVERRIDE = "<override>"


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Legacy:
    """One key of a class's flat form: where it lives now (``path``, in the class), and how its value
    reads there (``new``) and back (``old``) where the section changed its spelling."""

    key: str
    path: tuple[str, ...]
    new: Callable[[Any], Any] = _same
    old: Callable[[Any], Any] = _same


class SettingsModel(BaseModel):
    """Base of rlfleet's settings: unknown fields are rejected, assignments are validated, and the
    class says where its flat form's keys go (read by :func:`nest_legacy` and :func:`flatten`). It
    reads what it is given as it is given: a section whose container nests its input, or one that
    nests its own (the step settings, which a step reads without this module: its hot path), is
    a ``SettingsModel``; everything else is a :class:`ConfigModel`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    SHORT_FORM: ClassVar[str | None] = None
    """The field a plain string given for this section goes to (``algorithm: grpo`` -> ``name``)."""
    FLAT_SECTIONS: ClassVar[frozenset[str]] = frozenset()
    """This class's sections whose settings were top-level keys in the previous release."""
    RENAMED: ClassVar[tuple[Legacy, ...]] = ()
    """Flat keys whose place is not ``<section>.<same name>`` (or whose value is spelled otherwise)."""
    SHORT: ClassVar[frozenset[str]] = frozenset()
    """Flat keys kept as documented short forms (no warning)."""
    DEFAULT_TAGS: ClassVar[dict[str, str]] = {}
    """Tagged-union sections whose tag the flat form left to a default (``engine`` -> ``hf``): a section
    the flat form creates gets it; a nested one must name its ``type``."""
    WARN_LEGACY: ClassVar[bool] = False
    """Whether the flat form of this class is deprecated (a FutureWarning names the new keys)."""
    PLACE: ClassVar[str] = ""
    """Where this class sits in the job config, for the warning (``rollout``); empty: the top."""

    @classmethod
    def legacy(cls) -> dict[str, Legacy]:
        """Flat key -> its :class:`Legacy`: the settings of every flat section (theirs too, deeper
        down), and ``RENAMED``; shorter paths first."""
        return _legacy_table(cls)


class ConfigModel(SettingsModel):
    """Base of rlfleet configs: a :class:`SettingsModel` that nests its own input before validation
    (the flat form of the previous release, sections given in their short form; see the module
    docstring)."""

    @model_validator(mode="before")
    @classmethod
    def _nest_legacy(cls, data: Any) -> Any:
        if isinstance(data, str) and cls.SHORT_FORM is not None:
            return {cls.SHORT_FORM: data}
        if not isinstance(data, dict):
            return data
        if cls.legacy():
            data = nest_legacy(cls, data)
        for name in cls.model_fields:  # a section given in its short form (a tagged union: its tag)
            if isinstance(data.get(name), str) and any(m.SHORT_FORM for m in _members(cls, name)):
                data = {**data, name: _as_section(cls, name, data[name])}
        return cls.tidy(data)

    @classmethod
    def tidy(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A class's last word on its input once the flat form is nested (default: as it is)."""
        return data


def section_class(annotation: Any) -> type[SettingsModel] | None:
    """The config class a field holds as a section (``X`` or ``X | None``); None for anything else
    (a scalar, a list or dict of models, a union of several models)."""
    if isinstance(annotation, type) and issubclass(annotation, SettingsModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in get_args(annotation) if a is not type(None)]
        if len(models) == 1:
            return section_class(models[0])
    return None


def union_members(annotation: Any) -> list[type[SettingsModel]]:
    """The config classes of a tagged-union field (``A | B``, in ``Annotated[...]`` too)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return union_members(get_args(annotation)[0])
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return []
    members = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, SettingsModel)]
    return members if len(members) > 1 else []


def _members(cls: type[SettingsModel], field: str) -> list[type[SettingsModel]]:
    annotation = cls.model_fields[field].annotation
    section = section_class(annotation)
    return [section] if section is not None else union_members(annotation)


@functools.cache
def _legacy_table(cls: type[SettingsModel]) -> dict[str, Legacy]:
    table: dict[str, Legacy] = {}
    fields = cls.model_fields
    for name in sorted(cls.FLAT_SECTIONS):
        for sub in _members(cls, name):
            for inner in sub.model_fields:
                if inner not in fields:
                    table.setdefault(inner, Legacy(inner, (name, inner)))
            for key, legacy in sub.legacy().items():
                if key not in fields:
                    table.setdefault(key, Legacy(key, (name, *legacy.path), legacy.new, legacy.old))
    for legacy in cls.RENAMED:
        table = {k: v for k, v in table.items() if v.path != legacy.path}
        table[legacy.key] = legacy
    return dict(sorted(table.items(), key=lambda item: len(item[1].path)))


def _as_section(cls: type[SettingsModel] | None, field: str, value: Any) -> Any:
    """A section's value as a mapping: a model's set fields, or a plain string as its short form."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    if isinstance(value, dict) or value is None:
        return dict(value or {})
    if cls is None or field not in cls.model_fields or not isinstance(value, str):
        return value
    keys = {m.SHORT_FORM for m in _members(cls, field) if m.SHORT_FORM}
    return {keys.pop(): value} if len(keys) == 1 else value


def nest_legacy(cls: type[SettingsModel], data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with the keys of ``cls``'s flat form moved into their sections (the flat one wins
    where a setting is given both ways); a FutureWarning names them where ``cls.WARN_LEGACY``."""
    out = dict(data)
    moved: list[str] = []
    for key, legacy in cls.legacy().items():
        if key not in out or key in cls.model_fields:
            continue
        value = legacy.new(out.pop(key))
        table: dict[str, Any] = out
        owner: type[SettingsModel] | None = cls
        for part in legacy.path[:-1]:
            created = table.get(part) is None
            inner = _as_section(owner, part, table.get(part))
            if not isinstance(inner, dict):  # not a section: leave the key for validation to name
                out[key] = value
                break
            if created and owner is not None and part in owner.DEFAULT_TAGS:  # the previous default
                tag = next(m.SHORT_FORM for m in _members(owner, part) if m.SHORT_FORM)
                inner.setdefault(tag, owner.DEFAULT_TAGS[part])
            table[part] = inner
            table = inner
            members = _members(owner, part) if owner is not None and part in owner.model_fields else []
            owner = members[0] if len(members) == 1 else None
        else:
            last, held = legacy.path[-1], table.get(legacy.path[-1])
            table[last] = merge(held, value) if isinstance(held, dict) and isinstance(value, dict) else value
            if key not in cls.SHORT:
                moved.append(f"{key} -> {'.'.join(legacy.path)}")
    if moved and cls.WARN_LEGACY:
        where = f" in {cls.PLACE}" if cls.PLACE else ""
        warnings.warn(
            f"{cls.__name__}: the flat form{where} is deprecated (it loads until the next release); write "
            + ", ".join(moved),
            FutureWarning,
            stacklevel=2,
        )
    return out


def legacy_dump(model: BaseModel, *, exclude_defaults: bool = True) -> dict[str, Any]:
    """``model`` as JSON data in its class's flat form (the previous release's): what an older reader
    of a worker config file or of the step settings takes."""
    data = model.model_dump(mode="json", exclude_defaults=exclude_defaults)
    return flatten(type(model), data) if isinstance(model, SettingsModel) else data


def _member_of(members: list[type[SettingsModel]], value: Mapping[str, Any]) -> type[SettingsModel]:
    """The class of a section's data: the one member, or the union member its tag names (a tag field
    has no default, so a dump without defaults still carries it)."""
    for member in members:
        tag = member.SHORT_FORM
        if tag is None or len(members) == 1:
            continue
        if value.get(tag) in get_args(member.model_fields[tag].annotation):
            return member
    return members[0]


def flatten(cls: type[SettingsModel], data: Mapping[str, Any]) -> dict[str, Any]:
    """Nested JSON data of ``cls`` in its flat form (the inverse of :func:`nest_legacy`): each flat
    section's settings hoisted to the top, a tagged union's tag its value, renamed keys spelled as
    they were."""
    out: dict[str, Any] = {}
    renamed = {legacy.path: legacy for legacy in cls.RENAMED if len(legacy.path) == 2}
    for key, value in data.items():
        members = _members(cls, key) if key in cls.model_fields and isinstance(value, dict) else []
        if not members:
            out[key] = value
            continue
        inner = flatten(_member_of(members, value), value)
        if key not in cls.FLAT_SECTIONS:  # a section the previous release nested too: only its insides change
            out[key] = inner
            continue
        for name, setting in inner.items():  # hoisted, under its previous name
            legacy = renamed.get((key, name))
            out[legacy.key if legacy else name] = legacy.old(setting) if legacy else setting
    return out


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
    an unknown field or a value of the wrong type. Each layer's flat form (:func:`nest_legacy`) is
    nested before the next is laid on it, so a nested key over a flat file still wins.
    """
    raw = _nested(model_cls, copy.deepcopy(data) if data else {})
    if path is not None:
        raw = merge(raw, _nested(model_cls, read_config_file(path)))
    sectioned = isinstance(model_cls, type) and issubclass(model_cls, SettingsModel)
    if isinstance(overrides, str) or not sectioned:
        apply_overrides(raw, overrides)
    else:
        for override in overrides:  # each in turn: one may write the short form the next opens
            _open_short_forms(model_cls, raw, [override])
            apply_overrides(raw, [override])
    try:
        return model_cls.model_validate(raw)
    except ValidationError as exc:
        raise _as_config_error(model_cls, exc) from None


def _nested(model_cls: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``model_cls``'s flat form moved into its sections (as it is for other classes)."""
    if issubclass(model_cls, SettingsModel) and model_cls.legacy():
        return nest_legacy(model_cls, data)
    return data


def _open_short_forms(model_cls: type[SettingsModel], raw: dict[str, Any], overrides: Sequence[str]) -> None:
    """A section written in its short form (``model: tiny:digits``) becomes a table where an override
    sets a setting inside it (``model.mixed_precision=none``)."""
    if isinstance(overrides, str):
        return  # apply_overrides names the mistake
    for text in overrides:
        parts = text.partition("=")[0].strip().split(".")
        table: Any = raw
        owner: type[SettingsModel] | None = model_cls
        for part in parts[:-1]:
            if not isinstance(table, dict):
                break
            if owner is not None and part in owner.model_fields and isinstance(table.get(part), str):
                table[part] = _as_section(owner, part, table[part])
            members = _members(owner, part) if owner is not None and part in owner.model_fields else []
            owner = members[0] if len(members) == 1 else None
            table = table.get(part)


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
    """``"; did you mean 'lr'? known fields: ..."`` for an unknown field at ``loc``, when findable. A
    short form is suggested as it is (``learning_rate``), a flat key of the previous release by its
    new place (``eval_dat`` -> ``eval.data``)."""
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
    places = {name: name for name in known}
    if issubclass(owner, SettingsModel):
        for key, legacy in owner.legacy().items():
            places.setdefault(key, key if key in owner.SHORT else ".".join(legacy.path))
    close = difflib.get_close_matches(str(loc[-1]), list(places), n=1)
    hint = f"; did you mean {places[close[0]]!r}?" if close else ""
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
