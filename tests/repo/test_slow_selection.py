"""Which tests marked ``slow`` a run takes (``tests/conftest.py``): none by default, all with ``--slow``,
one share of them with ``--slow-share K/N``, and whatever an explicit ``-m`` says. Each case runs
pytest on a small suite of its own under the real conftest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
SLOW = [f"test_slow_{i}" for i in range(5)]
PLAIN = ["test_plain_0", "test_plain_1"]


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makeini(
        "[pytest]\naddopts = --strict-markers\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    slow: long\n"
    )
    body = ["import pytest"]
    body += [f"@pytest.mark.slow\ndef {name}():\n    pass" for name in SLOW]
    body += [f"def {name}():\n    pass" for name in PLAIN]
    pytester.makepyfile(test_sample="\n\n".join(body))
    return pytester


def collected(suite: pytest.Pytester, *args: str) -> list[str]:
    result = suite.runpytest("--collect-only", "-q", *args)
    assert result.ret == 0, result.stdout.str()
    return [line.split("::")[1] for line in result.stdout.lines if "::" in line]


def test_a_plain_run_leaves_the_slow_tests_out_and_counts_them(suite: pytest.Pytester) -> None:
    result = suite.runpytest("-q")
    result.assert_outcomes(passed=len(PLAIN), deselected=len(SLOW))
    assert collected(suite, "--slow") == SLOW + PLAIN


def test_the_shares_of_the_slow_tests_partition_them(suite: pytest.Pytester) -> None:
    shares = [collected(suite, "--slow-share", f"{k}/3") for k in range(3)]
    for share in shares:
        assert [name for name in share if name in PLAIN] == PLAIN  # the plain tests run in every share
    slow = [sorted(name for name in share if name in SLOW) for share in shares]
    assert sorted(name for share in slow for name in share) == SLOW
    assert {len(share) for share in slow} <= {1, 2}
    assert collected(suite, "-m", "slow", "--slow-share", "1/3") == slow[1]  # CI's form: the share alone


def test_an_explicit_mark_expression_decides(suite: pytest.Pytester) -> None:
    assert collected(suite, "-m", "slow") == SLOW
    assert collected(suite, "-m", "not slow", "--slow") == PLAIN


@pytest.mark.parametrize("spec", ["3/3", "1", "a/2", "-1/2", "1/0"])
def test_a_bad_share_is_a_usage_error_naming_the_form(suite: pytest.Pytester, spec: str) -> None:
    result = suite.runpytest("--collect-only", "-q", f"--slow-share={spec}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--slow-share takes K/N" in result.stderr.str()


def test_ci_runs_a_share_of_the_slow_tests_picked_by_the_commit() -> None:
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    share = [step for step in steps if "--slow-share" in step]
    assert len(share) == 1 and share[0].startswith("uv run --extra cpu pytest -q -m slow --slow-share")
    assert re.search(r"git rev-parse .*HEAD", share[0]), "the share follows the commit"
