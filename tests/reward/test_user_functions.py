"""User reward functions 'module:function': loading, arguments, metadata, failures."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlfleet.reward.errors import RewardFunctionError, RewardImportError, UnknownRewardArgument
from rlfleet.reward.registry import build_reward

SOURCE = """
    calls = []

    def length_ratio(prompt, response, **metadata):
        return len(response) / max(1, len(prompt))

    def scaled(prompt, response, *, scale=1.0, offset=0):
        return scale * len(response) + offset

    def matches(prompt, response, answer):
        return float(response == answer)

    def boom(prompt, response, **metadata):
        if response == "bad":
            raise ZeroDivisionError("no way")
        return 1.0

    def returns_text(prompt, response, **metadata):
        return "high"

    def returns_nan(prompt, response, **metadata):
        return float("nan")

    def one_arg(prompt):
        return 0.0

    def sees(prompt, response, **metadata):
        calls.append(metadata)
        return 0.0

    NOT_CALLABLE = 3
"""


@pytest.fixture
def user_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package ``userrw_<random>`` with a ``scores`` module on sys.path; returns the module path."""
    name = f"userrw_{uuid.uuid4().hex[:8]}"
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"{name}.scores"
    for mod in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[mod]


def test_user_function_scores_with_weight(user_pkg: str) -> None:
    reward = build_reward(f"0.5*{user_pkg}:length_ratio + concise:max_words=3")
    batch = reward.score(["abcd"], ["ab"])
    assert batch.components[f"{user_pkg}:length_ratio"] == [0.5]
    assert batch.total == [0.25 + 1.0]


def test_spec_args_are_passed_as_keywords(user_pkg: str) -> None:
    reward = build_reward(f"{user_pkg}:scaled:scale=2,offset=1")
    assert reward.score(["p", "p"], ["abc", ""]).total == [7.0, 1.0]


def test_functions_without_kwargs_get_only_the_metadata_they_name(user_pkg: str) -> None:
    reward = build_reward(f"{user_pkg}:matches")
    batch = reward.score(["p", "p"], ["x", "y"], [{"answer": "x", "other": 1}, {"answer": "x"}])
    assert batch.total == [1.0, 0.0]


def test_spec_args_win_over_metadata(user_pkg: str) -> None:
    reward = build_reward(f"{user_pkg}:sees:tag=spec")
    reward.score(["p"], ["r"], [{"tag": "meta", "answer": 3}])
    assert importlib.import_module(user_pkg).calls == [{"tag": "spec", "answer": 3}]


def test_unknown_argument_for_a_user_function(user_pkg: str) -> None:
    with pytest.raises(UnknownRewardArgument, match=r"takes no argument 'scal'.*offset, scale"):
        build_reward(f"{user_pkg}:scaled:scal=2")


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ("nosuchpkg_zz.mod:fn", "import of 'nosuchpkg_zz.mod' failed"),
        ("{pkg}:missing", "has no attribute 'missing'"),
        ("{pkg}:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a callable"),
        ("{pkg}:one_arg", "cannot take \\(prompt, response"),
    ],
)
def test_loading_errors_name_the_function(user_pkg: str, target: str, match: str) -> None:
    target = target.format(pkg=user_pkg)
    with pytest.raises(RewardImportError, match=match) as info:
        build_reward(target)
    assert info.value.target == target
    assert isinstance(info.value, ValueError)


def test_a_raising_function_names_itself_and_the_sample(user_pkg: str) -> None:
    reward = build_reward(f"concise + {user_pkg}:boom")
    with pytest.raises(
        RewardFunctionError, match=r"boom' failed on sample 2: ZeroDivisionError: no way"
    ) as info:
        reward.score(["p"] * 3, ["ok", "ok", "bad"])
    assert info.value.function == f"{user_pkg}:boom"
    assert info.value.index == 2
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    ("fn", "match"), [("returns_text", "returned 'high'"), ("returns_nan", "not a finite")]
)
def test_non_numeric_results_are_refused(user_pkg: str, fn: str, match: str) -> None:
    reward = build_reward(f"{user_pkg}:{fn}")
    with pytest.raises(RewardFunctionError, match=match):
        reward.score(["p"], ["r"])
