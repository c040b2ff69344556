"""``scripts/release.py`` for real, in a temporary clone of this repository.

Each test clones the repository (its committed state, with the working tree's release scripts laid
over it), runs the script there with this interpreter, and checks what it left: the version in the
pyproject and the lock, the CHANGELOG's sections, the commit and tag, the checked wheel and sdist
with the LICENSE; and that every refusal exits 2 with its reason and changes nothing.
"""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ("release.py", "release_build.py")
DATE = "2031-02-03"

pytestmark = [
    pytest.mark.slow,  # each release runs `uv lock` and `uv build` (about 30 s)
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("uv") is None or shutil.which("git") is None, reason="needs uv and git"),
]


def git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=clone, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A clone of the repository whose release scripts are the working tree's (committed there)."""
    target = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO), str(target)], check=True)
    git(target, "config", "user.name", "release test")
    git(target, "config", "user.email", "release-test@example.invalid")
    for name in SCRIPTS:
        shutil.copy(REPO / "scripts" / name, target / "scripts" / name)
    if git(target, "status", "--porcelain"):
        git(target, "add", "scripts")
        git(target, "commit", "-q", "-m", "release scripts from the working tree")
    return target


def release(clone: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "scripts/release.py", *args, "--date", DATE]
    return subprocess.run(command, cwd=clone, capture_output=True, text=True, timeout=500)


def version_of(clone: Path, short: str) -> str:
    return tomllib.loads((clone / "packages" / short / "pyproject.toml").read_text())["project"]["version"]


def bumped(version: str, part: str) -> str:
    major, minor, patch = (int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", version).groups())  # type: ignore[union-attr]
    return f"{major}.{minor + 1}.0" if part == "minor" else f"{major}.{minor}.{patch + 1}"


def sections(changelog: str) -> list[tuple[str, str]]:
    """``(heading, body)`` of each ``## `` section."""
    parts = re.split(r"^## (.+)$", changelog, flags=re.MULTILINE)
    return [(parts[i].strip(), parts[i + 1].strip()) for i in range(1, len(parts), 2)]


def locked_version(clone: Path, name: str) -> str:
    lock = tomllib.loads((clone / "uv.lock").read_text())
    return next(p["version"] for p in lock["package"] if p["name"] == name)


def test_release_bumps_moves_the_changelog_builds_commits_and_tags(clone: Path) -> None:
    old = version_of(clone, "reward")
    new = bumped(old, "patch")
    before = sections((clone / "packages/reward/CHANGELOG.md").read_text())
    done = release(clone, "reward", new)
    assert done.returncode == 0, done.stderr
    tag = f"rlfleet-reward-v{new}"
    assert f"tagged {tag}" in done.stdout

    assert version_of(clone, "reward") == new and locked_version(clone, "rlfleet-reward") == new
    after = sections((clone / "packages/reward/CHANGELOG.md").read_text())
    assert after[0] == ("Unreleased", "")
    assert after[1] == (f"{new} ({DATE})", before[0][1])  # the unreleased entries, now under the version
    assert after[2:] == before[1:]
    assert git(clone, "rev-parse", f"{tag}^{{commit}}") == git(clone, "rev-parse", "HEAD")
    assert git(clone, "log", "-1", "--format=%s").strip() == f"Release rlfleet-reward {new}"
    assert set(git(clone, "show", "--name-only", "--format=", "HEAD").split()) == {
        "packages/reward/pyproject.toml", "packages/reward/CHANGELOG.md", "uv.lock",
    }  # fmt: skip
    assert git(clone, "status", "--porcelain") == ""

    dist = clone / "dist" / f"rlfleet-reward-{new}"
    stem = f"rlfleet_reward-{new}"
    license_text = (clone / "LICENSE").read_bytes()
    assert b"Apache License" in license_text and b"Version 2.0" in license_text
    with zipfile.ZipFile(dist / f"{stem}-py3-none-any.whl") as wheel:
        meta = email.parser.Parser().parsestr(wheel.read(f"{stem}.dist-info/METADATA").decode())
        assert wheel.read(f"{stem}.dist-info/licenses/LICENSE") == license_text
        assert not [n for n in wheel.namelist() if "__pycache__" in n or n.startswith("tests/")]
    assert (meta["Name"], meta["Version"], meta["License-Expression"]) == (
        "rlfleet-reward",
        new,
        "Apache-2.0",
    )
    with tarfile.open(dist / f"{stem}.tar.gz") as sdist:
        assert sdist.extractfile(f"{stem}/LICENSE").read() == license_text  # type: ignore[union-attr]
        assert f"{stem}/src/rlfleet/reward/__init__.py" in sdist.getnames()


def test_refusals_exit_2_and_change_nothing(clone: Path) -> None:
    current = version_of(clone, "trainer")  # never tagged: its first release may keep the version
    first = release(clone, "trainer", current)
    assert first.returncode == 0, first.stderr
    head, tags = git(clone, "rev-parse", "HEAD"), git(clone, "tag")
    assert tags.split() == [f"rlfleet-trainer-v{current}"]

    cases = [
        (("trainer", current), f"tag rlfleet-trainer-v{current} already exists"),
        (("trainer", "0.0.0"), f"version 0.0.0 is not greater than rlfleet-trainer's current {current}"),
        (("nope", "1.0.0"), "unknown package 'nope'"),
        (("trainer", "1.2"), "write it as X.Y.Z"),
        (("trainer", bumped(current, "patch")), "the unreleased section is empty"),
    ]
    for args, reason in cases:
        done = release(clone, *args)
        assert done.returncode == 2 and reason in done.stderr, (args, done.stderr)
    (clone / "notes.txt").write_text("uncommitted")
    done = release(clone, "rollout", bumped(version_of(clone, "rollout"), "patch"))
    assert done.returncode == 2 and "the work tree has changes" in done.stderr and "notes.txt" in done.stderr
    (clone / "notes.txt").unlink()
    assert git(clone, "rev-parse", "HEAD") == head and git(clone, "tag") == tags
    assert git(clone, "status", "--porcelain") == "" and version_of(clone, "trainer") == current


def test_a_stray_file_in_the_wheel_stops_the_release_and_restores_the_tree(clone: Path) -> None:
    stray = clone / "packages/rollout/src/rlfleet/rollout/tests/test_left_behind.py"
    stray.parent.mkdir()
    stray.write_text("x = 1\n")
    git(clone, "add", str(stray))
    git(clone, "commit", "-q", "-m", "a test file inside the package")
    head, old = git(clone, "rev-parse", "HEAD"), version_of(clone, "rollout")
    done = release(clone, "rollout", bumped(old, "patch"))
    assert done.returncode == 2 and "stray files" in done.stderr and "test_left_behind.py" in done.stderr
    assert git(clone, "rev-parse", "HEAD") == head and git(clone, "tag") == ""
    assert git(clone, "status", "--porcelain") == "" and version_of(clone, "rollout") == old


def test_a_breaking_common_release_moves_every_dependents_range(clone: Path) -> None:
    new = bumped(version_of(clone, "common"), "minor")
    done = release(clone, "common", new)
    assert done.returncode == 0, done.stderr
    major, minor = (int(x) for x in new.split(".")[:2])
    bound = f">={new},<{major}.{minor + 1}" if major == 0 else f">={new},<{major + 1}"
    for short in ("rollout", "reward", "trainer", "controller"):
        project = tomllib.loads((clone / "packages" / short / "pyproject.toml").read_text())["project"]
        extras = "" if short == "reward" else "[torch]"  # the others need common's torch tensors
        spec = f"rlfleet-common{extras}{bound}"
        assert spec in project["dependencies"], (short, project["dependencies"])
        unreleased = sections((clone / "packages" / short / "CHANGELOG.md").read_text())[0]
        assert f"Requires `{spec}`" in unreleased[1], (short, unreleased)
    assert locked_version(clone, "rlfleet-common") == new
    assert git(clone, "status", "--porcelain") == ""
