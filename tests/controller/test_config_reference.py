"""docs/config.md, the job file's reference, is generated from the config classes and in step with them.

``scripts/config_reference.py`` walks ``JobConfig`` (every ``TrainerConfig`` section and each
variant of a tagged one) and writes one row per key with its type, default and description. A field
added, renamed or redescribed without regenerating the file fails here, with the command to run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from pydantic import BaseModel

from rlfleet.controller.config import AdaptiveKL, JobConfig, RayLauncher, TrainerConfig

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "rlfleet_config_reference", ROOT / "scripts" / "config_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()


def test_docs_config_md_is_in_step_with_the_config_classes() -> None:
    written = (ROOT / "docs" / "config.md").read_text() if (ROOT / "docs" / "config.md").exists() else ""
    assert written == SCRIPT.render(), (
        "docs/config.md is out of step with the config classes: regenerate it with "
        f"`{SCRIPT.COMMAND}` and commit the result"
    )


def _leaf_keys(model: type[BaseModel], path: str = "") -> set[str]:
    """Every dotted key of ``model`` that holds a value (sections opened, a tagged union's variants too)."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        sections = [
            m for m in SCRIPT._members(field.annotation) if isinstance(m, type) and issubclass(m, BaseModel)
        ]
        if sections:
            for section in sections:
                keys |= _leaf_keys(section, key)
        else:
            keys.add(key)
    return keys


def test_every_key_of_the_job_has_a_row_with_a_description() -> None:
    text = SCRIPT.render()
    rows = {line.split("`")[1]: line for line in text.splitlines() if line.startswith("| `")}
    keys = _leaf_keys(JobConfig)
    assert {"update.learning_rate", "batch.group_size", "kl.target", "launcher.address", "data.path"} <= keys
    assert keys - set(rows) == set()
    undescribed = sorted(key for key, line in rows.items() if line.rstrip().endswith("|  |"))
    assert undescribed == [], f"fields without a description: {undescribed}"
    # every TrainerConfig section and run-wide key is reachable from the reference
    for name in TrainerConfig.model_fields:
        assert f"`{name}" in text, name


def test_the_reference_says_types_defaults_and_variants() -> None:
    text = SCRIPT.render()
    assert "| `max_staleness` | int | 0 |" in text
    assert "| `kl.target` | float | required |" in text  # AdaptiveKL's target has no default
    assert "## `kl` (type: adaptive)" in text and AdaptiveKL.model_fields["horizon"].default == 10000
    ray = text.split("## `launcher` (type: ray)", 1)[1].split("\n## ", 1)[0]
    assert all(f"| `launcher.{name}` |" in ray for name in RayLauncher.model_fields)
    assert SCRIPT.type_name(dict[str, int | None]) == "dict[str, int | null]"
