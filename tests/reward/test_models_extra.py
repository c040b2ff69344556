"""The reward server installs with rules only: torch and transformers come with the ``models`` extra.

A spec of rule rewards builds and scores without either (a process in which both fail to import);
a reward model or sentence encoder asked for without them is refused with one error that names the
extra to install. In the workspace the extra is installed, so the absence is made by blocking the
imports; in ``scripts/isolated_tests.py``'s reward venv it is real, and the last test runs there.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.reward import build_reward
from rlfleet.reward.errors import RewardModelError

pytestmark = pytest.mark.timeout(120)

BLOCK = "import sys\nfor name in ('torch', 'transformers'):\n    sys.modules[name] = None\n"
"""Makes ``import torch`` / ``import transformers`` fail in the process, as where they are not installed."""


def _requirement_names(marker: str | None) -> set[str]:
    """Names of rlfleet-reward's requirements with (``marker``: that extra's) or without a marker."""
    names = set()
    for requirement in importlib.metadata.requires("rlfleet-reward") or []:
        name, _, condition = requirement.partition(";")
        name = name.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip()
        if (marker is None and not condition) or (marker is not None and f"'{marker}'" in condition):
            names.add(name)
    return names


def test_the_package_needs_torch_and_transformers_only_with_the_models_extra() -> None:
    assert not {"torch", "transformers"} & _requirement_names(None)
    assert {"torch", "transformers"} <= _requirement_names("models")
    assert "rlfleet-reward" in _requirement_names("similarity")  # similarity = models (+ MiniLM's weights)


def test_rule_rewards_build_and_score_without_torch_or_transformers() -> None:
    code = BLOCK + (
        "import rlfleet.reward, rlfleet.reward.service, rlfleet.reward.main, rlfleet.reward.admin\n"
        "from rlfleet.reward import build_reward\n"
        "reward = build_reward('concise:max_words=3 + exact_match + charset:allowed=0123456789')\n"
        "batch = reward.score(['2+2?', '2+2?'], ['4', 'it is five'], [{'answer': '4'}, {'answer': '4'}])\n"
        "print(batch.total)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    first, second = eval(done.stdout)  # noqa: S307 - a list of two floats printed by the child
    assert first == pytest.approx(3.0) and second < first


@pytest.mark.parametrize("spec", ["rm:path={folder}", "similarity:key=answer,model={folder}"])
def test_a_model_without_the_extra_is_refused_naming_it(
    spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as where rlfleet-reward[models] is not installed
    # where the server is installed without the extra, torch is absent too and named beside transformers
    with pytest.raises(
        RewardModelError, match=r"need (torch and )?transformers.*pip install 'rlfleet-reward\[models\]'"
    ):
        build_reward(spec.format(folder=tmp_path))


HAS_MODELS_EXTRA = importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(HAS_MODELS_EXTRA, reason="the models extra is installed")
def test_installed_without_the_extra_a_model_is_refused_naming_it(tmp_path: Path) -> None:
    """Runs in the rules-only venv of scripts/isolated_tests.py, where transformers is really absent."""
    with pytest.raises(RewardModelError, match=r"pip install 'rlfleet-reward\[models\]'"):
        build_reward(f"rm:path={tmp_path}")
