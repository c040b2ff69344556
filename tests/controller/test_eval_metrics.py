"""Evaluation metrics, the eval settings, metrics.jsonl reading and run-dir expansion (no processes)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlfleet.common.errors import ConfigError
from rlfleet.controller.eval_metrics import (
    EvalRow,
    make_row,
    pass_at_k,
    render_table,
    summarize,
    summary_line,
)
from rlfleet.controller.eval_settings import EvalSettings
from rlfleet.controller.evaluation import model_targets
from rlfleet.controller.plots import read_metrics


@pytest.mark.parametrize(("n", "c", "k"), [(5, 0, 1), (5, 2, 1), (5, 2, 3), (4, 4, 2), (6, 1, 6), (7, 3, 2)])
def test_pass_at_k_is_the_chance_that_k_drawn_answers_hold_a_correct_one(n: int, c: int, k: int) -> None:
    answers = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    brute = sum(any(answers[i] for i in draw) for draw in draws) / len(draws)
    assert math.isclose(pass_at_k(n, c, k), brute)


def test_pass_at_k_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(3, 1, 4)


def test_summary_means_come_from_the_rows() -> None:
    answers = {0: ["one two three", "a b c d e f"], 1: ["x", "y z"]}
    rows = [make_row(i, f"q{i}", s, text, 3 * (s + 1), limit_words=3)
            for i, texts in answers.items() for s, text in enumerate(texts)]  # fmt: skip
    for row, correct in zip(rows, [True, False, False, False], strict=True):
        row.correct = correct
        row.similarity = 0.5 if correct else 0.25
        row.rewards = {"concise": 1.0 if row.within_limit else 0.0}
        row.components = {"concise": {"concise": row.rewards["concise"]}}
    summary = summarize(rows, limit_words=3)
    words = [len(text.split()) for texts in answers.values() for text in texts]
    assert summary["mean_words"] == sum(words) / 4
    assert summary["within_limit"] == sum(w <= 3 for w in words) / 4
    assert summary["mean_tokens"] == (3 + 6 + 3 + 6) / 4
    assert summary["similarity"] == (0.5 + 0.25 * 3) / 4
    assert summary["rewards"] == {"concise": 0.75} and summary["components"]["concise"]["concise"] == 0.75
    assert summary["pass@1"] == (pass_at_k(2, 1, 1) + pass_at_k(2, 0, 1)) / 2
    assert summary["pass@2"] == (1.0 + 0.0) / 2
    table = render_table(["m"], [summary])
    assert table.splitlines()[0].split()[:6] == ["MODEL", "ANSWERS", "WORDS", "TOKENS", "<=3W", "SIMILARITY"]
    assert f"{summary['mean_words']:.1f}" in table.splitlines()[1]


def test_a_multi_turn_runs_summary_has_its_tool_use_and_turns() -> None:
    """Episodes' rows carry their turns and tool calls: the summary's tool use is the share of answers
    that called a tool at least once; a single-turn run's summary has neither key."""
    rows = [make_row(i, "q", 0, "943", 4, limit_words=50) for i in range(4)]
    for row, (turns, calls) in zip(rows, [(2, 1), (1, 0), (3, 2), (1, 0)], strict=True):
        row.turns, row.tool_calls = turns, calls
    summary = summarize(rows, 50)
    assert summary["tool_use"] == 0.5 and summary["mean_turns"] == 1.75
    assert "tool use 0.50, turns 1.75" in summary_line(summary)
    back = EvalRow.from_json(json.loads(json.dumps(rows[2].to_json())))
    assert (back.turns, back.tool_calls) == (3, 2)
    plain = summarize([make_row(0, "q", 0, "a", 1, limit_words=50)], 50)
    assert "tool_use" not in plain and "tool use" not in summary_line(plain)


def test_eval_every_needs_eval_data() -> None:
    with pytest.raises(ValidationError, match=r"eval.every=3 needs eval.data"):
        EvalSettings(every=3)
    assert EvalSettings(data="held.jsonl", every=3).every == 3
    with pytest.raises(ValidationError):
        EvalSettings(data="held.jsonl", every=-1)


def test_read_metrics_names_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "reward/mean": 0.5, "kl": "NaN"}) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"metrics\.jsonl:2.*not a JSON line"):
        read_metrics(path)
    path.write_text(json.dumps({"step": 1, "reward/mean": 0.5, "kl": "NaN", "note": "x"}) + "\n")
    series = read_metrics(path)
    assert series["reward/mean"] == [(1, 0.5)] and math.isnan(series["kl"][0][1]) and "note" not in series
    path.write_text(json.dumps({"reward/mean": 0.5}) + "\n")
    with pytest.raises(ConfigError, match="integer step"):
        read_metrics(path)


def test_a_run_dir_expands_to_its_checkpoints_then_final(tmp_path: Path) -> None:
    for folder in ("checkpoint-10/hf", "checkpoint-2/hf", "final", "checkpoint-5"):
        (tmp_path / folder).mkdir(parents=True)
    for folder in ("checkpoint-10/hf", "checkpoint-2/hf", "final"):
        (tmp_path / folder / "config.json").write_text("{}")
    run = str(tmp_path)
    assert model_targets(run) == [
        (f"{run}/checkpoint-2", f"{run}/checkpoint-2/hf"),
        (f"{run}/checkpoint-10", f"{run}/checkpoint-10/hf"),
        (f"{run}/final", f"{run}/final"),
    ]
    assert model_targets(f"{run}/checkpoint-2") == [(f"{run}/checkpoint-2", f"{run}/checkpoint-2/hf")]
    assert model_targets("tiny:x") == [("tiny:x", "tiny:x")]
    assert model_targets(str(tmp_path / "checkpoint-5")) == [(str(tmp_path / "checkpoint-5"),) * 2]
