"""Build one rlfleet package's wheel and sdist and check them before they are published.

``python scripts/release_build.py rlfleet-reward-v0.3.0`` is the release workflow's build step: it
checks that the tag names a package of this repo and that package's version, builds that package
alone (``uv build --package --no-sources``) into ``dist/`` and checks both files; ``release.py``
runs the same build and checks before it commits and tags. The checks:

- the metadata (wheel ``METADATA``, sdist ``PKG-INFO``): name, version, Requires-Python,
  ``License-Expression: Apache-2.0`` and ``License-File: LICENSE``, the extras the pyproject declares;
- the LICENSE file is in both, byte for byte the repository's;
- nothing stray: only the package's own module (no ``rlfleet/__init__.py``: ``rlfleet`` is a
  namespace shared by five packages), its dist-info, and in the sdist pyproject/README/LICENSE;
  no ``__pycache__``, ``*.pyc``, tests, virtual environments or VCS folders.

Uses only the standard library (the workflow runs it without the workspace installed).
"""

from __future__ import annotations

import argparse
import email.parser
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "rollout", "reward", "trainer", "controller")
"""The publishable packages, by short name (the folder under packages/); ``rlfleet-<name>`` on PyPI."""
LICENSE_EXPRESSION = "Apache-2.0"
VERSION = re.compile(r"\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?")
"""A release version: X.Y.Z, or a pre-release X.Y.Z(a|b|rc)N."""
TAG = re.compile(rf"^rlfleet-(?P<package>[a-z]+)-v(?P<version>{VERSION.pattern})$")
"""A release tag: ``rlfleet-<package>-v<version>``."""
STRAY_PARTS = frozenset({"__pycache__", "tests", "test", ".venv", "venv", ".git", ".pytest_cache",
                         ".ruff_cache", ".hypothesis", ".mypy_cache", ".DS_Store"})  # fmt: skip
STRAY_SUFFIXES = (".pyc", ".pyo", ".orig.py", ".rej", ".swp", "~")


class ReleaseError(Exception):
    """A release step refused or failed; the message says what and what to do."""


@dataclass(frozen=True)
class Project:
    """What the package's pyproject.toml says that the built files must match."""

    short: str
    name: str
    version: str
    requires_python: str
    extras: tuple[str, ...]

    @property
    def folder(self) -> Path:
        return ROOT / "packages" / self.short

    @property
    def stem(self) -> str:
        """File-name form of ``name-version`` (``rlfleet_reward-0.2.0``)."""
        return f"{self.name.replace('-', '_')}-{self.version}"


def short_name(package: str) -> str:
    """``reward`` for ``reward`` or ``rlfleet-reward``; ReleaseError for anything else."""
    short = package.removeprefix("rlfleet-")
    if short not in PACKAGES:
        known = ", ".join(PACKAGES)
        raise ReleaseError(f"unknown package {package!r}: one of {known} (or rlfleet-<name>)")
    return short


def load_project(short: str) -> Project:
    """The package's name, version, requires-python and extras from its pyproject.toml."""
    data = tomllib.loads((ROOT / "packages" / short / "pyproject.toml").read_text())["project"]
    extras = tuple(sorted(data.get("optional-dependencies", {})))
    return Project(short, data["name"], data["version"], data.get("requires-python", ""), extras)


def parse_tag(tag: str) -> tuple[str, str]:
    """``(short package name, version)`` of a release tag; ReleaseError if it is not one or if the
    package's pyproject says another version."""
    found = TAG.fullmatch(tag.removeprefix("refs/tags/"))
    if found is None:
        raise ReleaseError(f"tag {tag!r} is not a release tag rlfleet-<package>-v<X.Y.Z>")
    short, version = short_name(found["package"]), found["version"]
    current = load_project(short).version
    if current != version:
        raise ReleaseError(
            f"tag {tag!r} says version {version} but packages/{short}/pyproject.toml says {current}; "
            "tag the commit that release.py made"
        )
    return short, version


def build(project: Project, out_dir: Path) -> tuple[Path, Path]:
    """``uv build`` the package alone (no workspace sources) into ``out_dir``; (wheel, sdist)."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    command = ["uv", "build", "--package", project.name, "--no-sources", "--out-dir", str(out_dir)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise ReleaseError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    wheel = out_dir / f"{project.stem}-py3-none-any.whl"
    sdist = out_dir / f"{project.stem}.tar.gz"
    for path in (wheel, sdist):
        if not path.is_file():
            found = ", ".join(p.name for p in out_dir.iterdir())
            raise ReleaseError(f"uv build made no {path.name} (it made: {found})")
    return wheel, sdist


def check_metadata(project: Project, text: str, where: str) -> None:
    """The core metadata fields a PyPI upload of ``project`` must carry."""
    meta: Message = email.parser.Parser().parsestr(text)
    expected = {
        "Name": project.name,
        "Version": project.version,
        "Requires-Python": project.requires_python,
        "License-Expression": LICENSE_EXPRESSION,
        "License-File": "LICENSE",
        "Description-Content-Type": "text/markdown",
    }
    for field, value in expected.items():
        if meta.get(field) != value:
            raise ReleaseError(f"{where}: {field} is {meta.get(field)!r}, expected {value!r}")
    extras = tuple(sorted(meta.get_all("Provides-Extra") or []))
    if extras != project.extras:
        raise ReleaseError(f"{where}: extras {extras} differ from the pyproject's {project.extras}")
    if not (meta.get_payload() or "").strip():
        raise ReleaseError(f"{where}: no long description (the package README)")


def stray(names: list[str], exact: set[str], prefixes: tuple[str, ...]) -> list[str]:
    """Archive entries that are neither in ``exact`` nor under ``prefixes``, or that look like
    build, test or VCS leftovers."""
    bad = []
    for name in names:
        parts = name.rstrip("/").split("/")
        if name not in exact and not name.startswith(prefixes):
            bad.append(name)
        elif STRAY_PARTS.intersection(parts) or name.endswith(STRAY_SUFFIXES):
            bad.append(name)
    return bad


def check_wheel(project: Project, wheel: Path) -> None:
    """Metadata, LICENSE and contents of the built wheel."""
    module = f"rlfleet/{project.short}/"
    info = f"{project.stem}.dist-info/"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        check_metadata(project, archive.read(info + "METADATA").decode(), wheel.name)
        if info + "licenses/LICENSE" not in names:
            raise ReleaseError(f"{wheel.name}: no {info}licenses/LICENSE")
        if archive.read(info + "licenses/LICENSE") != (ROOT / "LICENSE").read_bytes():
            raise ReleaseError(f"{wheel.name}: its LICENSE differs from the repository's")
    bad = stray(names, {"rlfleet/"}, (module, info))
    if bad:
        raise ReleaseError(f"{wheel.name}: stray files {bad[:10]}; only {module} and {info} belong")
    if not any(n == f"{module}__init__.py" for n in names):
        raise ReleaseError(f"{wheel.name}: no {module}__init__.py")


def check_sdist(project: Project, sdist: Path) -> None:
    """Metadata, LICENSE and contents of the built sdist."""
    top = f"{project.stem}/"
    with tarfile.open(sdist) as archive:
        names = [m.name + ("/" if m.isdir() else "") for m in archive.getmembers()]
        pkg_info = archive.extractfile(top + "PKG-INFO")
        license_file = archive.extractfile(top + "LICENSE") if top + "LICENSE" in names else None
        if pkg_info is None or license_file is None:
            raise ReleaseError(f"{sdist.name}: PKG-INFO or LICENSE is missing")
        check_metadata(project, pkg_info.read().decode(), sdist.name)
        if license_file.read() != (ROOT / "LICENSE").read_bytes():
            raise ReleaseError(f"{sdist.name}: its LICENSE differs from the repository's")
    # pyproject.toml.orig: uv_build keeps the pyproject as written next to the one it normalized
    files = ("PKG-INFO", "pyproject.toml", "pyproject.toml.orig", "README.md", "LICENSE")
    exact = {top, top + "src/", top + "src/rlfleet/", *(top + f for f in files)}
    bad = stray(names, exact, (f"{top}src/rlfleet/{project.short}/",))
    if bad:
        raise ReleaseError(f"{sdist.name}: stray files {bad[:10]}")


def build_and_check(project: Project, out_dir: Path) -> tuple[Path, Path]:
    """Build the package and run every check (and ``twine check`` when twine is on PATH)."""
    wheel, sdist = build(project, out_dir)
    check_wheel(project, wheel)
    check_sdist(project, sdist)
    twine = shutil.which("twine")
    if twine is not None:
        done = subprocess.run(
            [twine, "check", "--strict", str(wheel), str(sdist)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise ReleaseError(f"twine check failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return wheel, sdist


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag", help="release tag rlfleet-<package>-v<version> (refs/tags/ prefix allowed)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "dist", help="where the files go (emptied)")
    args = parser.parse_args(argv)
    try:
        short, _ = parse_tag(args.tag)
        wheel, sdist = build_and_check(load_project(short), args.out_dir)
    except ReleaseError as exc:
        print(f"release_build: error: {exc}", file=sys.stderr)
        return 2
    print(f"built and checked {wheel.name} and {sdist.name} in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
