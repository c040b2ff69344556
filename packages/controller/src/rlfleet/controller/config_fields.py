"""``rlfleet config --fields``: every key of a job file as YAML, each under a comment holding its
description (the config classes' field descriptions), with its default as the value; and the short
list of the keys most runs set, which ``rlfleet train --help`` prints.

The YAML loads (``yaml.safe_load``) to the job's keys with their defaults; a key without a default
reads ``null`` under a ``(required)`` comment. A section with variants (``kl``, ``launcher``,
``rollout.engine``) shows its default variant, and its comment names the others (their keys are
in ``docs/config.md``).
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rlfleet.common.schema.config import section_class, union_members

MAIN_KEYS = (
    "model", "reward", "data.path", "algorithm", "num_epochs", "max_steps", "update.learning_rate",
    "update.kl_coef", "batch.group_size", "batch.rollout_batch_size", "batch.train_batch_size",
    "max_prompt_length", "max_response_length", "rollout.engine", "output_dir", "save_every",
    "resume_from", "loggers",
)  # fmt: skip
"""The keys most runs set, in the order a job file usually holds them."""

WIDTH = 100


def fields_yaml(cls: type[BaseModel]) -> str:
    """Every key of ``cls`` (a job config class) as commented YAML."""
    return "\n".join(_section(cls, 0)) + "\n"


def _section(cls: type[BaseModel], depth: int, instance: BaseModel | None = None) -> list[str]:
    """The lines of ``cls``'s keys at ``depth``; ``instance``: the default variant of a tagged section,
    whose values (its tag included) are shown."""
    lines: list[str] = []
    pad = "  " * depth
    for name, info in cls.model_fields.items():
        required = instance is None and info.is_required()
        default = getattr(instance, name) if instance is not None else _default(info)
        section, inner = section_class(info.annotation), None
        members = union_members(info.annotation)
        note = ""
        if members:
            tags = [str(m.model_fields[m.SHORT_FORM].description) for m in members if m.SHORT_FORM]
            note = f" (variants by type: {', '.join(tags)})" if tags else ""
            if isinstance(default, BaseModel):
                section, inner = type(default), default
        lines += _comment(pad, (info.description or "") + note)
        if section is not None and (required or default is None or isinstance(default, BaseModel)):
            lines.append(f"{pad}{name}:{' # (required)' if required else ''}")
            lines += _section(section, depth + 1, inner if inner is not None else None)
            continue
        lines.append(f"{pad}{name}: {'null  # (required)' if required else _scalar(default)}")
    return lines


def _default(info: FieldInfo) -> Any:
    if info.is_required():
        return None
    value = info.get_default(call_default_factory=True)
    return None if value is PydanticUndefined else value


def _scalar(value: Any) -> str:
    """``value`` as one line of YAML (a flow mapping or list where it is one)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    else:
        value = json.loads(json.dumps(value, default=str))
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def _comment(pad: str, text: str) -> list[str]:
    """``text`` as ``#`` lines of at most :data:`WIDTH` characters."""
    words, lines, line = " ".join(text.split()).split(" "), [], ""
    for word in words:
        if line and len(pad) + 2 + len(line) + 1 + len(word) > WIDTH:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return [f"{pad}# {part}" for part in lines]


def describe(cls: type[BaseModel], dotted: str) -> str:
    """The description of the field at ``dotted`` (``batch.group_size``) in ``cls``."""
    owner: Any = cls
    info: FieldInfo | None = None
    for part in dotted.split("."):
        info = owner.model_fields[part]
        owner = section_class(info.annotation)
    assert info is not None, dotted
    return " ".join((info.description or "").split())


def main_keys_text(cls: type[BaseModel]) -> str:
    """``rlfleet train --help``'s list of the main keys, each with its description."""
    rows = [f"  {key:<26} {describe(cls, key)}" for key in MAIN_KEYS]
    return (
        "main keys (write them in the job file or as KEY=VALUE; update.* and batch.* also at the top):\n"
        + ("\n".join(row if len(row) <= WIDTH else row[: WIDTH - 3] + "..." for row in rows))
    )
