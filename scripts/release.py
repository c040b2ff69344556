"""Release one rlfleet package: ``python scripts/release.py PACKAGE VERSION``.

On a clean work tree, for PACKAGE (``reward`` or ``rlfleet-reward``) and a VERSION (X.Y.Z or
X.Y.Z(a|b|rc)N) greater than the one in its pyproject.toml (or equal to it while that version was
never tagged: a package's first release), with no tag ``rlfleet-PACKAGE-vVERSION`` yet:

1. sets ``version`` in ``packages/PACKAGE/pyproject.toml`` (the one place a version is written;
   ``__version__`` reads the installed metadata);
2. renames the CHANGELOG's unreleased section (the first ``## `` heading, ``## Unreleased`` or
   ``## X.Y.Z (unreleased)``) to ``## VERSION (YYYY-MM-DD)`` and opens an empty ``## Unreleased``
   above it; a missing or empty unreleased section is refused (nothing to release);
3. when VERSION leaves the range a dependent declares on PACKAGE (only ``rlfleet-common`` has
   dependents: ``rlfleet-common>=0.1.0,<0.2``), moves that range to ``>=VERSION,<NEXT`` (NEXT: the
   next minor while 0.x, else the next major) and notes it in the dependent's unreleased section;
   the dependents are released on their own later. A version inside the range changes no dependent;
4. ``uv lock`` (the lock records each member's version);
5. builds the wheel and sdist and checks them (``release_build.py``) into ``dist/PACKAGE-VERSION/``;
6. commits those files and makes the annotated tag ``rlfleet-PACKAGE-vVERSION``.

Nothing is pushed: ``git push origin HEAD rlfleet-PACKAGE-vVERSION`` then starts the release
workflow, which builds that package alone and publishes it (PyPI trusted publishing). Any refusal
exits 2 before a file is changed; a failed build puts the edited files back.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
from pathlib import Path

from packaging.version import Version
from release_build import PACKAGES, ROOT, VERSION, ReleaseError, build_and_check, load_project, short_name

HEADING = re.compile(r"^## (?P<title>.+)$", re.MULTILINE)
UNRELEASED = re.compile(r"^(unreleased|\S+ \(unreleased\))$", re.IGNORECASE)
VERSION_LINE = re.compile(r'^version = "(?P<version>[^"]+)"$', re.MULTILINE)


def git(*args: str) -> str:
    """Run git in the repository; its stdout, or ReleaseError with its stderr."""
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise ReleaseError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def check_can_release(short: str, version: str) -> Version:
    """Refuse a dirty tree, a malformed version, an existing tag, a version not above the current
    (the current itself only while it was never tagged: a package's first release); the version."""
    dirty = git("status", "--porcelain").strip()
    if dirty:
        shown = "\n  ".join(dirty.splitlines()[:10])
        raise ReleaseError(f"the work tree has changes; commit or remove them first:\n  {shown}")
    if not VERSION.fullmatch(version):
        raise ReleaseError(f"version {version!r}: write it as X.Y.Z or X.Y.Z(a|b|rc)N, e.g. 0.3.0")
    if tag_exists(release_tag(short, version)):
        raise ReleaseError(f"tag {release_tag(short, version)} already exists; pick the next version")
    new, current = Version(version), Version(load_project(short).version)
    if new < current or (new == current and tag_exists(release_tag(short, str(current)))):
        raise ReleaseError(f"version {version} is not greater than rlfleet-{short}'s current {current}")
    return new


def release_tag(short: str, version: str) -> str:
    """``rlfleet-<short>-v<version>``."""
    return f"rlfleet-{short}-v{version}"


def tag_exists(tag: str) -> bool:
    return bool(git("tag", "--list", tag).strip())


def move_unreleased(text: str, version: str, date: str, where: str) -> str:
    """The changelog with its unreleased section under ``## VERSION (date)`` and a new empty one."""
    first = HEADING.search(text)
    if first is None or not UNRELEASED.match(first["title"].strip()):
        raise ReleaseError(f"{where}: no unreleased section (a first heading '## Unreleased') to release")
    following = HEADING.search(text, first.end())
    body = text[first.end() : following.start() if following else len(text)]
    if not body.strip():
        raise ReleaseError(f"{where}: the unreleased section is empty; say what changed first")
    return f"{text[: first.start()]}## Unreleased\n\n## {version} ({date}){text[first.end() :]}"


def add_unreleased_line(text: str, line: str, where: str) -> str:
    """``line`` as the first entry of the unreleased section (opening one if there is none)."""
    first = HEADING.search(text)
    if first is None:
        raise ReleaseError(f"{where}: has no '## ' section")
    entry = f"- {line}\n"
    if not UNRELEASED.match(first["title"].strip()):
        return f"{text[: first.start()]}## Unreleased\n\n{entry}\n{text[first.start() :]}"
    rest = text[first.end() :].lstrip("\n")
    return f"{text[: first.end()]}\n\n{entry}{'' if rest.startswith('- ') else chr(10)}{rest}"


def next_breaking(version: Version) -> str:
    """The first version that may break ``version``'s API: the next minor while 0.x, else major."""
    return f"0.{version.minor + 1}" if version.major == 0 else f"{version.major + 1}"


def update_dependents(short: str, new: Version) -> list[Path]:
    """Move each dependent's ``rlfleet-SHORT>=A,<B`` (or ``rlfleet-SHORT[extra]>=A,<B``, the extra
    kept) to include ``new`` when it does not; the edited files."""
    pattern = re.compile(rf'"rlfleet-{short}(?P<extras>\[[^\]"]*\])?>=(?P<low>[^,"]+),<(?P<high>[^"]+)"')
    edited: list[Path] = []
    for other in PACKAGES:
        pyproject = ROOT / "packages" / other / "pyproject.toml"
        text = pyproject.read_text()
        found = pattern.search(text)
        if other == short or found is None:
            continue
        if Version(found["low"]) <= new < Version(found["high"]):
            continue
        spec = f"rlfleet-{short}{found['extras'] or ''}>={new},<{next_breaking(new)}"
        pyproject.write_text(text[: found.start()] + f'"{spec}"' + text[found.end() :])
        changelog = ROOT / "packages" / other / "CHANGELOG.md"
        line = f"Requires `{spec}` (rlfleet-{short} {new} was released)."
        changelog.write_text(add_unreleased_line(changelog.read_text(), line, str(changelog)))
        edited += [pyproject, changelog]
    return edited


def release(short: str, version: str, date: str) -> tuple[str, list[Path]]:
    """Every step after the refusals; the tag made and the built files."""
    new = check_can_release(short, version)
    folder = ROOT / "packages" / short
    pyproject, changelog = folder / "pyproject.toml", folder / "CHANGELOG.md"
    moved = move_unreleased(changelog.read_text(), version, date, str(changelog.relative_to(ROOT)))
    text = pyproject.read_text()
    if VERSION_LINE.search(text) is None:
        raise ReleaseError(f"{pyproject}: no 'version = \"...\"' line")
    finished = False
    try:
        pyproject.write_text(VERSION_LINE.sub(f'version = "{version}"', text, count=1))
        changelog.write_text(moved)
        edited = [pyproject, changelog, *update_dependents(short, new), ROOT / "uv.lock"]
        done = subprocess.run(["uv", "lock"], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise ReleaseError(f"uv lock failed:\n{done.stderr[-2000:]}")
        built = build_and_check(load_project(short), ROOT / "dist" / f"rlfleet-{short}-{version}")
        finished = True
    finally:
        if not finished:  # the tree was clean: put back what this run changed
            git("checkout", "--", "packages", "uv.lock")
    paths = [str(p.relative_to(ROOT)) for p in edited]
    tag = release_tag(short, version)
    git("add", "--", *paths)
    git("commit", "-q", "-m", f"Release rlfleet-{short} {version}", "--", *paths)
    git("tag", "-a", tag, "-m", f"rlfleet-{short} {version}")
    return tag, list(built)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", help=f"one of {', '.join(PACKAGES)} (or rlfleet-<name>)")
    parser.add_argument("version", help="the new version, X.Y.Z (or X.Y.Z(a|b|rc)N)")
    parser.add_argument("--date", default=datetime.date.today().isoformat(), help="release date (YYYY-MM-DD)")
    args = parser.parse_args(argv)
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", args.date):
            raise ReleaseError(f"--date {args.date!r} is not YYYY-MM-DD")
        tag, built = release(short_name(args.package), args.version, args.date)
    except ReleaseError as exc:
        print(f"release: error: {exc}", file=sys.stderr)
        return 2
    print(f"tagged {tag}; built and checked {', '.join(p.name for p in built)}")
    print(f"publish: git push origin HEAD {tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
