"""Real builds of other rlfleet releases, for the wire compatibility tests (issue 15 point 3).

``previous.toml`` names the previous release: a git revision of this repository. Its packages are
built from that revision (``git archive`` into a temporary folder, ``uv build``) and installed into
fresh virtual environments, with the third-party versions of that revision's own lock (``uv
export``; uv's cache makes torch and the rest cheap): :func:`previous_tiers` (rlfleet-common,
-rollout, -reward, -trainer) and :func:`previous_controller` (rlfleet-common, -controller: its
launcher finds the tiers' console scripts on PATH). :func:`next_major` is this working tree with
the wire protocol's MAJOR version bumped, built the same way (rlfleet-common, -rollout): the honest
stand-in for a release that this one must refuse. Each is built once per session.

Without the revision in this clone's history (a shallow clone that cannot be deepened) the tests
skip, saying so; a build that fails is an error.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.control.messages import PROTOCOL

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
"""This environment's console scripts: the current release of every package."""
PREVIOUS = tomllib.loads((Path(__file__).parent / "previous.toml").read_text())
TIER_PACKAGES = ("rlfleet-common", "rlfleet-rollout", "rlfleet-reward", "rlfleet-trainer")
BASE = "packages/common/src/rlfleet/common/control/messages/base.py"  # where PROTOCOL is written


@dataclass(frozen=True)
class Release:
    """An installed build of some rlfleet packages: its virtual environment and its wire version."""

    venv: Path
    protocol: str

    def script(self, name: str) -> str:
        """The path of console script ``name`` in this build's environment."""
        return str(self.venv / "bin" / name)


def _uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    if not found:
        pytest.skip("uv is not installed: the compatibility builds use uv build, uv export and uv venv")
    return found


def _run(command: Sequence[str | Path], cwd: Path, timeout: float = 600) -> str:
    """Run a build step; a failure fails the test, showing the step's output."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}  # uv acts on the folder it is given
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def install(source: Path, packages: Sequence[str], venv: Path) -> None:
    """Build ``packages`` from the uv workspace at ``source`` and install them into a fresh ``venv``,
    with the third-party packages at the versions of ``source``'s lock."""
    uv = _uv()
    dist = venv.with_name(venv.name + "-dist")
    for package in packages:
        _run([uv, "build", "--quiet", "--wheel", "--package", package, "--out-dir", dist], source)
    pins = venv.with_name(venv.name + "-requirements.txt")
    chosen = [arg for package in packages for arg in ("--package", package)]
    _run([uv, "export", "--quiet", "--frozen", "--no-hashes", "--no-dev", "--no-emit-workspace", *chosen,
          "--output-file", pins], source)  # fmt: skip
    _run([uv, "venv", "--quiet", "--python", sys.executable, venv], source)
    python = venv / "bin" / "python"
    _run([uv, "pip", "install", "--quiet", "--python", python, "-r", pins], source)  # pyc on first import
    wheels = sorted(dist.glob("*.whl"))
    _run([uv, "pip", "install", "--quiet", "--python", python, "--no-deps", *wheels], source)


def built(source: Path, packages: Sequence[str], venv: Path, protocol: str) -> Release:
    """:func:`install`, then check that the build speaks ``protocol``."""
    install(source, packages, venv)
    probe = "from rlfleet.common.control.messages import PROTOCOL; print(PROTOCOL)"
    spoken = _run([venv / "bin" / "python", "-c", probe], source).strip()
    assert spoken == protocol, f"the build in {venv} speaks wire {spoken}, not {protocol}"
    return Release(venv, protocol)


def _has(revision: str) -> bool:
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{revision}^{{commit}}"],
                           capture_output=True, timeout=60)  # fmt: skip
    return found.returncode == 0


def previous_revision() -> str:
    """The previous release's revision, deepening a shallow clone once; skips without it."""
    revision = str(PREVIOUS["revision"])
    if not (REPO / ".git").exists():
        pytest.skip(f"{REPO} is not a git clone: the previous release ({revision}) cannot be built")
    if not _has(revision):
        shallow = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True, timeout=60).stdout.strip()  # fmt: skip
        if shallow == "true":
            subprocess.run(["git", "-C", str(REPO), "fetch", "--quiet", "--unshallow"], capture_output=True,
                           timeout=600)  # fmt: skip
    if not _has(revision):
        pytest.skip(f"the previous release's revision {revision} (tests/compat/previous.toml) is not in "
                    "this clone's history; clone the repository in full (not shallow) to run these "
                    "tests")  # fmt: skip
    return revision


def bump_major(protocol: str) -> str:
    """``"2.4"`` -> ``"3.0"``."""
    return f"{int(protocol.split('.')[0]) + 1}.0"


def copy_working_tree(dest: Path) -> None:
    """This working tree's workspace files (tracked, and new ones git does not ignore) into ``dest``."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
         "pyproject.toml", "uv.lock", "LICENSE", "README.md", "packages"],
        capture_output=True, check=True, timeout=60,
    ).stdout.decode()  # fmt: skip
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)


@pytest.fixture(scope="session")
def previous() -> dict[str, Any]:
    """``previous.toml``: the previous release's ``revision`` and the wire ``protocol`` it speaks."""
    return dict(PREVIOUS)


@pytest.fixture(scope="session")
def previous_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's source tree (``git archive`` of its revision)."""
    revision = previous_revision()
    source = tmp_path_factory.mktemp("previous-source")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], capture_output=True, check=True,
                             timeout=120).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    return source


@pytest.fixture(scope="session")
def previous_tiers(previous_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The previous release's rollout, reward and trainer tiers (and its rlfleet-common)."""
    venv = tmp_path_factory.mktemp("previous-tiers") / "venv"
    return built(previous_source, TIER_PACKAGES, venv, str(PREVIOUS["protocol"]))


@pytest.fixture(scope="session")
def previous_controller(previous_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The previous release's controller (and its rlfleet-common), without any tier."""
    venv = tmp_path_factory.mktemp("previous-controller") / "venv"
    return built(previous_source, ("rlfleet-common", "rlfleet-controller"), venv, str(PREVIOUS["protocol"]))


@pytest.fixture(scope="session")
def next_major(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """This working tree's rollout tier with the wire protocol's MAJOR version bumped."""
    source = tmp_path_factory.mktemp("next-major-source")
    copy_working_tree(source)
    protocol = bump_major(PROTOCOL)
    base = source / BASE
    text, count = re.subn(r'^PROTOCOL = "[0-9.]+"', f'PROTOCOL = "{protocol}"', base.read_text(), flags=re.M)
    assert count == 1, f"no PROTOCOL line in {BASE}"
    base.write_text(text)
    venv = tmp_path_factory.mktemp("next-major") / "venv"
    return built(source, ("rlfleet-common", "rlfleet-rollout"), venv, protocol)


@pytest.fixture(scope="session")
def run_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment of the ``rlfleet train`` processes: a model cache of this session, no W&B network,
    and this environment's console scripts first on PATH."""
    return {
        **os.environ,
        "RLFLEET_CACHE": str(tmp_path_factory.mktemp("rlfleet-cache")),
        "WANDB_MODE": "offline",
        "PYTHONUNBUFFERED": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
