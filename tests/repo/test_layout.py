"""The architecture holds: no import cycles, single-base classes, no hub typed ``Any``, and every
setting defined once.

These read the source (``ast``) and the config classes themselves; they import nothing heavy.
"""

from __future__ import annotations

import ast
import builtins
import typing
from collections import defaultdict
from pathlib import Path

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(ROOT.glob("packages/*/src/rlfleet/**/*.py"))
GENERATED = "/_gen/"


def _module_name(path: Path) -> str:
    parts = path.with_suffix("").parts
    parts = parts[parts.index("src") + 1 :]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SOURCES if GENERATED not in str(p)}


def _imports(path: Path) -> set[str]:
    """The rlfleet modules ``path`` imports anywhere (top level, functions, TYPE_CHECKING blocks)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("rlfleet."):
                found.add(name)
    found.discard(_module_name(path))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_anywhere() -> None:
    """No module imports (at any level, even inside a function) a module that imports it back.

    A package's ``__init__`` importing its own submodules is the one edge left out: Python runs a
    package's ``__init__`` before its submodules, so that is not a cycle a reader has to untangle.
    """
    graph = {
        name: {m for m in _imports(path) if not (path.name == "__init__.py" and m.startswith(name + "."))}
        for name, path in MODULES.items()
    }
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _classes() -> list[tuple[str, ast.ClassDef]]:
    out = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out.append((name, node))
    return out


def test_every_class_but_an_error_class_has_a_single_base() -> None:
    """No mixin towers: a class has one base, except an error class (its rlfleet kind and a builtin,
    ``class X(UserError, ValueError)``). A config is composed of sections, never of several bases."""
    many = []
    for module, node in _classes():
        bases = [ast.unparse(b) for b in node.bases]
        if len(bases) <= 1:
            continue
        if all(hasattr(builtins, b) or b.endswith(("Error", "Failure", "Exception")) for b in bases):
            continue  # an error class: its rlfleet kind and its builtin kind
        many.append(f"{module}.{node.name}({', '.join(bases)})")
    assert many == []


# --- ports, not the run ------------------------------------------------------------------------

HUBS = frozenset({"run", "fleet", "launcher", "program"})
"""Names that once held the whole run (or its fleet, launcher, step program) typed ``Any`` to dodge an
import back; each now has a port in ``rlfleet.controller.ports``."""


def _mentions_any(annotation: ast.expr | None) -> bool:
    """Whether an annotation is, or has in it, ``Any`` (``Any``, ``Any | None``, ``typing.Any``,
    ``"Any"``)."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Any":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                if _mentions_any(ast.parse(node.value, mode="eval").body):
                    return True
            except SyntaxError:
                continue
    return False


def _hubs_typed_any(tree: ast.AST) -> list[str]:
    """``name: Any`` of a hub name in ``tree``: a parameter, a variable, an attribute (``self.fleet``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            params = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            found += [
                f"{p.arg} (line {p.lineno})"
                for p in params
                if p is not None and p.arg in HUBS and _mentions_any(p.annotation)
            ]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            if name in HUBS and _mentions_any(node.annotation):
                found.append(f"{ast.unparse(target)} (line {node.lineno})")
    return found


def test_no_run_fleet_launcher_or_program_is_typed_any() -> None:
    """A helper receives the typed ports it uses (issue 28): no parameter, variable or attribute named
    ``run``, ``fleet``, ``launcher`` or ``program`` is annotated ``Any`` anywhere in the packages."""
    found = {module: _hubs_typed_any(ast.parse(path.read_text())) for module, path in MODULES.items()}
    assert {module: hits for module, hits in found.items() if hits} == {}


def test_the_any_finder_finds_hubs_typed_any() -> None:
    code = """
class Helper:
    def __init__(self, run: Any, fleet: "Any | None", *, launcher: typing.Any, program: StepProgram) -> None:
        self.launcher: Any = launcher
        self.fleet: FleetClient = fleet
        config: Any = None

async def step(batch: list[Any], fleet: FleetClient | None = None, *program: Any) -> Any: ...
"""
    assert sorted(_hubs_typed_any(ast.parse(code))) == [
        "fleet (line 3)", "launcher (line 3)", "program (line 8)", "run (line 3)", "self.launcher (line 4)",
    ]  # fmt: skip


# --- every setting defined once ----------------------------------------------------------------


def _roots() -> dict[str, type[BaseModel]]:
    from rlfleet.common.schema.reward import RewardWorkerConfig
    from rlfleet.common.schema.rollout import RolloutWorkerConfig
    from rlfleet.common.schema.trainer import TrainerWorkerConfig
    from rlfleet.controller.config import JobConfig

    return {"job": JobConfig, "trainer": TrainerWorkerConfig, "rollout": RolloutWorkerConfig,
            "reward": RewardWorkerConfig}  # fmt: skip


def _owner(cls: type[BaseModel], field: str) -> type[BaseModel]:
    """The class in ``cls``'s MRO that declares ``field`` itself."""
    for klass in cls.__mro__:
        if field in klass.__dict__.get("__annotations__", {}):
            return klass
    raise AssertionError(f"{cls.__name__}.{field} has no declaring class")


def _nested(annotation: object) -> list[type[BaseModel]]:
    """Config classes inside a field's type (``X``, ``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _nested(arg)]


def _core(annotation: object) -> str:
    """A field's type without ``None``, for telling homonyms of different kinds apart."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, type(int | None)) and args:
        return " | ".join(sorted(_core(a) for a in args))
    return repr(annotation)


Declared = dict[type[BaseModel], object]
"""The classes that declare a field at one path, each with the field's type (a tagged union's members
each declare theirs at the same path)."""

HOMONYMS = {  # one name, one type, two settings: each in its own section of the job
    "cluster": ["FleetAddress", "RewardSettings"],  # the run's fleet / the shared reward server's
    "token": ["NatsConnection", "RewardSettings"],  # a NATS login's / the reward tenant's
    "workers": ["RolloutConfig", "RolloutPoolConfig"],  # the default pool's size / a named pool's
}


def _walk(cls: type[BaseModel], path: str, out: dict[str, Declared], seen: set[type]) -> None:
    """Every field of ``cls`` and of the sections it holds (each member of a tagged union too), by its
    dotted path."""
    for name, info in cls.model_fields.items():
        out.setdefault(f"{path}{name}", {})[_owner(cls, name)] = info.annotation
        for inner in _nested(info.annotation):
            if inner not in seen:
                _walk(inner, f"{path}{name}.", out, seen | {inner})


def _tree(root: str) -> dict[str, Declared]:
    fields: dict[str, Declared] = {}
    cls = _roots()[root]
    _walk(cls, "", fields, {cls})
    return fields


def _is_tag(name: str, owners: Declared) -> bool:
    """Whether the field is the tag of a tagged union's members (``type``), which each declares."""
    return all(getattr(owner, "SHORT_FORM", None) == name == "type" for owner in owners)


def _one_section(declared: Declared) -> bool:
    """Whether the field is a section everywhere, holding one class, or one class and the extension of
    it that the job holds (its ``model`` adds the model's name, its ``rollout`` sampling and pools)."""
    held = [_nested(annotation) for annotation in declared.values()]
    if not all(len(classes) == 1 for classes in held):
        return False
    classes = [classes[0] for classes in held]
    return any(all(issubclass(cls, base) for cls in classes) for base in classes)


def test_no_setting_is_defined_in_two_config_classes() -> None:
    """The same setting (path) in the four configs (the job, each tier's worker) is declared by one
    class: a section holding the same class in several configs is one setting, and each member of a
    tagged union declares its own tag. Inside one config a name is declared by two classes only for
    settings of different types (a tenant's list of endpoint names, the server's endpoint table) or for
    the listed homonyms, each in its own section; a section is not a setting (``fleet.nats_auth`` and
    ``reward.nats_auth`` are two uses of one class)."""
    trees = {root: _tree(root) for root in _roots()}
    declared: dict[str, Declared] = defaultdict(dict)
    for fields in trees.values():
        for path, owners in fields.items():
            declared[path].update(owners)
    twice = {
        path: sorted(owner.__qualname__ for owner in owners)
        for path, owners in declared.items()
        if len(owners) > 1 and not _one_section(owners) and not _is_tag(path.rpartition(".")[2], owners)
    }
    assert twice == {}, "a setting is declared by two classes"
    for root, fields in trees.items():
        by_name: dict[tuple[str, str], set[str]] = defaultdict(set)
        for path, owners in fields.items():
            name = path.rpartition(".")[2]
            for owner, annotation in owners.items():
                if not _nested(annotation) and not _is_tag(name, owners):
                    by_name[(name, _core(annotation))].add(owner.__qualname__)
        copies = {name: sorted(o) for (name, _), o in by_name.items() if len(o) > 1}
        assert copies == (HOMONYMS if root == "job" else {}), f"{root}: the same setting is declared twice"


SEEN = {
    "job": ["model.name", "model.mixed_precision", "update.learning_rate", "batch.group_size",
            "rollout.engine.colocate", "rollout.pools", "kl.target", "kl.end_coef", "launcher.gpus",
            "launcher.address", "eval.data", "reward.spec", "fleet.nats_auth.token", "data.path"],
    "trainer": ["model.compile", "step.update.learning_rate", "step.algorithm.name", "fleet.cluster"],
    "rollout": ["rollout.engine.type", "rollout.engine.max_model_len", "loading.trust_remote_code",
                "tensor_plane.advertise_host", "placement.seed"],
    "reward": ["endpoints", "tenants.endpoints", "loading.trust_remote_code", "fleet.nats_url"],
}  # fmt: skip


@pytest.mark.parametrize("root", ["job", "trainer", "rollout", "reward"])
def test_the_setting_walk_sees_nested_sections(root: str) -> None:
    fields = _tree(root)
    assert set(SEEN[root]) <= set(fields), sorted(set(SEEN[root]) - set(fields))
    assert {"learning_rate", "device", "eval_data"}.isdisjoint(fields)  # short and flat forms are no fields
    engines = {owner.__name__ for owner in fields.get("rollout.engine.type", {})}
    assert engines == ({"HFEngineSettings", "VLLMEngineSettings"} if root in ("job", "rollout") else set())
