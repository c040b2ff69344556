"""Write docs/config.md, the job file's reference, from the config classes' field descriptions.

Walks :class:`rlfleet.controller.config.JobConfig` (a ``TrainerConfig`` plus ``model.name``,
``reward.spec``, ``data`` and the epochs) through every nested section, and every variant of a
tagged section (``kl``, ``launcher``, ``rollout.engine``), and writes one table per section: each
key's dotted path, type, default and description. ``tests/controller/test_config_reference.py``
fails when the file is out of step with the classes; regenerate it with::

    uv run python scripts/config_reference.py          # writes docs/config.md
    uv run python scripts/config_reference.py --check  # exit 1 when docs/config.md is out of date
"""

from __future__ import annotations

import argparse
import enum
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "config.md"
COMMAND = "uv run python scripts/config_reference.py"

HEADER = f"""# Config reference

Every key of a job file (`rlfleet train job.yaml`), which is also a `TrainerConfig` keyword or
section and an `a.b.c=value` override on the command line. Generated from the config classes'
field descriptions by `scripts/config_reference.py`; do not edit by hand: run `{COMMAND}`
after changing a field (`tests/controller/test_config_reference.py` fails until you do).

A section given as a plain string is its short form (`model: smollm2`, `algorithm: ppo`,
`rollout.engine: vllm`, `launcher: ray`). Where a section has variants, its `type` picks one and
each variant takes only its own keys. The `update` and `batch` keys, `device`, `seed` and
`nats_url` may also be written at the top (`learning_rate=1e-5`). "required" marks a key without
a default.
"""


def _unwrap(annotation: Any) -> Any:
    """``Annotated[X, ...]`` -> ``X``."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _members(annotation: Any) -> list[Any]:
    """The members of a union (one member for anything else)."""
    annotation = _unwrap(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [_unwrap(arg) for arg in typing.get_args(annotation)]
    return [annotation]


def type_name(annotation: Any) -> str:
    """A short, readable name of a field's type: ``int``, ``list[str]``, ``grpo | ppo``."""
    annotation = _unwrap(annotation)
    if annotation is type(None) or annotation is None:
        return "null"
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(str(value) for value in typing.get_args(annotation))
    if origin in (list, tuple, set, frozenset, dict):
        args = ", ".join("..." if arg is Ellipsis else type_name(arg) for arg in typing.get_args(annotation))
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    if annotation is Any:
        return "any"
    if annotation is SecretStr:
        return "secret"
    if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
        return " | ".join(str(member.value) for member in annotation)
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, BaseModel):
        return "section"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _markdown(text: str) -> str:
    """Docstring text as Markdown on one line: ``x`` and Sphinx roles (:class:`~a.B`) become `x`, and
    ``<`` and ``>`` outside code are escaped (``checkpoint-<step>`` would be read as an HTML tag)."""
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts lie outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _cell(text: str) -> str:
    return _markdown(text).replace("|", "\\|")


def _doc(model: type[BaseModel]) -> str:
    """The first paragraph of a class's docstring."""
    doc = inspect.getdoc(model) or ""
    return _markdown(doc.split("\n\n", 1)[0])


def _sections(model: type[BaseModel], path: str, title: str, out: list[tuple[str, str, list[str]]]) -> None:
    """Append ``(title, intro, rows)`` for ``model`` at ``path``, then for each of its sections."""
    rows: list[str] = []
    nested: list[tuple[type[BaseModel], str, str]] = []
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        sections = [m for m in _members(field.annotation) if inspect.isclass(m) and issubclass(m, BaseModel)]
        if sections:
            tags = [_tag(m) for m in sections]
            if len(sections) > 1 and all(tags):
                for variant, tag in zip(sections, tags, strict=True):
                    nested.append((variant, key, f"`{key}` (type: {tag})"))
            else:
                nested.extend((m, key, f"`{key}`") for m in sections)
            continue
        rows.append(
            f"| `{key}` | {_cell(type_name(field.annotation))} | {_cell(_default(field))} "
            f"| {_cell(field.description or '')} |"
        )
    out.append((title, _doc(model), rows))
    for section, key, heading in nested:
        _sections(section, key, heading, out)


def _tag(model: type[BaseModel]) -> str | None:
    """The ``type`` tag of a tagged union's member (``adaptive`` for ``AdaptiveKL``), else None."""
    field = model.model_fields.get("type")
    if field is None or typing.get_origin(_unwrap(field.annotation)) is not typing.Literal:
        return None
    values = typing.get_args(_unwrap(field.annotation))
    return " | ".join(str(v) for v in values)


def render() -> str:
    """docs/config.md as it should read now."""
    from rlfleet.controller.config import JobConfig

    found: list[tuple[str, str, list[str]]] = []
    _sections(JobConfig, "", "Top level", found)
    contents = [f"- [{title.replace('`', '')}](#{_anchor(title)})" for title, _, _ in found]
    parts = [HEADER, "\n".join(contents) + "\n"]
    for title, intro, rows in found:
        parts.append(f"## {title}\n")
        if intro:
            parts.append(intro + "\n")
        if rows:
            parts.append(
                "| key | type | default | description |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"
            )
    return "\n".join(parts)


def _anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = title.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"docs/config.md is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
