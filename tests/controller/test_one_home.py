"""One home per concept in the controller: every setting declared in one config class (the job config
inherits the schema's, the workers' configs are the schema's), and no import cycle between its
modules (function-level and TYPE_CHECKING imports included)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel

from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.common.schema.trainer import TrainerWorkerConfig
from rlfleet.controller.config import JobConfig

PACKAGE = Path(__file__).resolve().parents[2] / "packages" / "controller" / "src" / "rlfleet" / "controller"


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models(arg)]


def _reachable(roots: list[type[BaseModel]]) -> set[type[BaseModel]]:
    """The config classes of ``roots``: themselves, their bases, the models their fields hold."""
    seen: set[type[BaseModel]] = set()
    todo = list(roots)
    while todo:
        cls = todo.pop()
        if cls in seen or cls is BaseModel:
            continue
        seen.add(cls)
        todo += [base for base in cls.__bases__ if issubclass(base, BaseModel)]
        todo += [model for field in cls.model_fields.values() for model in _models(field.annotation)]
    return seen


def test_every_setting_is_declared_once() -> None:
    declared: dict[str, list[str]] = defaultdict(list)
    for cls in _reachable([JobConfig, TrainerWorkerConfig, RolloutWorkerConfig]):
        for name in cls.__dict__.get("__annotations__", {}):
            if name in cls.model_fields:
                declared[name].append(cls.__qualname__)
    twice = {name: owners for name, owners in declared.items() if len(owners) > 1}
    assert twice == {}, f"declared in more than one config class: {twice}"
    assert {"learning_rate", "kl_coef", "beta", "max_cache_len", "kl_ctrl", "workers"} <= set(declared)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, wherever the import statement stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def test_no_controller_module_imports_one_that_imports_it_back() -> None:
    files = {f"rlfleet.controller.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    graph = {name: _imports(path, set(files)) - {name} for name, path in files.items()}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for dep in graph[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        return seen

    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in reach(b)})
    assert cycles == [], f"import cycles: {cycles}"
