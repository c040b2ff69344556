"""One home per concept in the controller: every setting declared in one config class (the job config's
sections are the schema's classes, the workers' configs are composed of the same ones), and no
import cycle between its modules (function-level and TYPE_CHECKING imports included)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel

from rlfleet.common.schema.config import section_class, union_members
from rlfleet.common.schema.rollout import RolloutSettings, RolloutWorkerConfig
from rlfleet.common.schema.trainer import ModelSettings, StepSettings, TrainerWorkerConfig
from rlfleet.common.schema.worker import ModelLoading, ServiceConfig
from rlfleet.controller.config import JobConfig, JobModel, TrainerConfig

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


SAME_NAME = {  # settings of one name that are different settings, each in its own section
    "cluster": {"FleetAddress", "RewardSettings"},  # the run's fleet / the shared reward server's
    "token": {"NatsConnection", "RewardSettings"},  # a NATS login's / the reward tenant's
    "workers": {"RolloutConfig", "RolloutPoolConfig"},  # the default pool's size / a named pool's
    "name": {"AlgorithmSettings", "JobModel"},  # the algorithm's / the model's
}


def _is_setting(cls: type[BaseModel], name: str) -> bool:
    """Whether field ``name`` of ``cls`` is a setting: not a section (a model, or a tagged union of
    models) nor a union member's tag (``type``), which each member declares for itself."""
    annotation = cls.model_fields[name].annotation
    return not _models(annotation) and not (name == "type" == getattr(cls, "SHORT_FORM", None))


def test_every_setting_is_declared_once() -> None:
    declared: dict[str, list[str]] = defaultdict(list)
    for cls in _reachable([JobConfig, TrainerWorkerConfig, RolloutWorkerConfig]):
        for name in cls.__dict__.get("__annotations__", {}):
            if name in cls.model_fields and _is_setting(cls, name):
                declared[name].append(cls.__qualname__)
    twice = {name: set(owners) for name, owners in declared.items() if len(owners) > 1}
    assert twice == SAME_NAME, f"declared in more than one config class: {twice}"
    assert all(len(owners) == len(set(owners)) for owners in declared.values())
    assert {"learning_rate", "kl_coef", "beta", "max_model_len", "target", "trust_remote_code"} <= set(
        declared
    )


def test_the_run_s_sections_are_the_tiers_classes_as_they_are() -> None:
    run = TrainerConfig.model_fields
    service = ServiceConfig.model_fields
    for name in ("fleet", "placement", "tensor_plane"):  # every worker's, and the run's
        assert section_class(run[name].annotation) is section_class(service[name].annotation), name
    for name in ("update", "algorithm", "batch"):  # what each step sends the trainer
        assert section_class(run[name].annotation) is section_class(
            StepSettings.model_fields[name].annotation
        )
    assert section_class(TrainerWorkerConfig.model_fields["step"].annotation) is StepSettings
    assert section_class(run["model"].annotation) is ModelSettings
    assert section_class(TrainerWorkerConfig.model_fields["model"].annotation) is ModelSettings
    assert issubclass(JobModel, ModelSettings) and issubclass(ModelSettings, ModelLoading)
    assert section_class(RolloutWorkerConfig.model_fields["loading"].annotation) is ModelLoading
    rollout = section_class(run["rollout"].annotation)
    assert rollout is not None and issubclass(rollout, RolloutSettings)  # the engine settings, as they are
    assert section_class(RolloutWorkerConfig.model_fields["rollout"].annotation) is RolloutSettings
    launchers, kls = union_members(run["launcher"].annotation), union_members(run["kl"].annotation)
    assert {m.__name__ for m in launchers} == {"EmbeddedLauncher", "RayLauncher"}
    assert {m.__name__ for m in kls} == {"FixedKL", "AdaptiveKL", "ScheduledKL"}


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
