"""Each package's tests need only that package: ``tests/<package>`` imports no other rlfleet package.

``scripts/isolated_tests.py`` runs ``tests/<package>`` in a venv holding only the package's wheel and
the ones it declares; this keeps the tests fit for that. It reads every ``.py`` file (conftest and
helper modules too) with ``ast`` and fails on an import of an rlfleet package the folder's package
does not declare in ``packages/<package>/pyproject.toml`` and on a file that loads another suite's
conftest. (A console script of another tier started from there shows up in the isolated run.)
Tests that join two tiers live in ``tests/integration``.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    """scripts/isolated_tests.py as a module: its package list, its reading of the declared dependencies."""
    spec = importlib.util.spec_from_file_location(
        "rlfleet_isolated_tests", ROOT / "scripts" / "isolated_tests.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()
PACKAGES = sorted(SCRIPT.PACKAGES)


def declared(package: str) -> set[str]:
    """``package`` and the rlfleet packages its pyproject.toml depends on (short names), transitively."""
    return {package, *SCRIPT.declared_rlfleet_dependencies(package)}


def rlfleet_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, rlfleet package)`` of every import anywhere in ``tree`` (top level, functions, strings
    given to ``importlib.import_module``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            first = node.args[0]
            names = [first.value] if isinstance(first, ast.Constant) and isinstance(first.value, str) else []
        else:
            continue
        found += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("rlfleet.") and "." in n]
    return found


def strings(tree: ast.AST) -> list[tuple[int, str]]:
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def problems(package: str) -> list[str]:
    """What in ``tests/<package>`` needs something ``package`` does not declare."""
    allowed = declared(package)
    found: list[str] = []
    for path in sorted((ROOT / "tests" / package).rglob("*.py")):
        where = path.relative_to(ROOT)
        tree = ast.parse(path.read_text(), str(path))
        for line, imported in rlfleet_imports(tree):
            if imported in PACKAGES and imported not in allowed:
                found.append(f"{where}:{line} imports rlfleet.{imported}")
        for line, text in strings(tree):
            if text.endswith("conftest.py"):  # tests/attacks' way of borrowing a suite's fixtures
                found.append(f"{where}:{line} loads a conftest file ({text!r})")
    return found


def test_every_package_has_a_test_folder() -> None:
    assert PACKAGES == sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    assert all((ROOT / "tests" / p).is_dir() for p in PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_tests_of_a_package_need_only_what_it_declares(package: str) -> None:
    found = problems(package)
    assert not found, (
        f"tests/{package} must run with only rlfleet-{package} (and {sorted(declared(package) - {package})}) "
        "installed (scripts/isolated_tests.py); move tests that join tiers to tests/integration, or build "
        "what they borrow in tests/" + package + ":\n  " + "\n  ".join(found)
    )


def test_the_check_sees_each_kind_of_import() -> None:
    """The reader catches top-level, nested, ``from`` and ``import_module`` imports and stays quiet on
    the rest (so a clean result above means something)."""
    source = (
        "import rlfleet.trainer.weights\n"
        "def f():\n    from rlfleet.controller import GRPOTrainer\n"
        "importlib.import_module('rlfleet.reward.spec')\n"
        "from rlfleet.common.errors import ConfigError\n"
        "import rlfleetx\nfrom . import rlfleet\n"
    )
    found = sorted(rlfleet_imports(ast.parse(source)))
    assert found == [(1, "trainer"), (3, "controller"), (4, "reward"), (5, "common")]
    assert declared("common") == {"common"} and "common" in declared("rollout")
