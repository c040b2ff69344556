"""The rewards of the example jobs on their own data: the committed tiny reward model
(examples/data/tiny_digits_rm, examples/tiny_ppo_rm.yaml) scores like the rule it was trained to
imitate, its script builds such a model, and ``numeric`` reads the generated word problems' answers
(examples/gsm8k_numeric.yaml). An integration test: the script builds its model with the
controller's character tokenizer (``rlfleet.controller.tokenizers``), the reward tier scores it."""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
from pathlib import Path
from types import ModuleType

import pytest

from rlfleet.reward.registry import build_reward

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
RM_SPEC = "rm:path={},input=response"  # as examples/tiny_ppo_rm.yaml
FIXED = ["123", "9 9 9", "abc", "hello", "", "12ab"]


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DATA / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rm_scores(folder: Path, texts: list[str]) -> list[float]:
    return list(build_reward(RM_SPEC.format(folder)).score(["q: 1 2 ->"] * len(texts), texts).total)


def _check_imitates_the_rule(folder: Path, *, min_corr: float, seed: int) -> None:
    script = _script("make_tiny_rm")
    rng = random.Random(seed)
    texts = [script.random_text(rng) for _ in range(200)]
    scores, rule = _rm_scores(folder, texts), [script.digit_share(text) for text in texts]
    assert statistics.correlation(scores, rule) > min_corr
    digits, letters, empty, mixed = (_rm_scores(folder, FIXED)[i] for i in (0, 2, 4, 5))
    assert digits > mixed > letters and digits > empty, _rm_scores(folder, FIXED)


def test_the_committed_reward_model_scores_the_share_of_digits() -> None:
    folder = DATA / "tiny_digits_rm"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    _check_imitates_the_rule(folder, min_corr=0.98, seed=7)
    two, one = _rm_scores(folder, ["12", "1a"])
    assert two == pytest.approx(1.0, abs=0.1) and one == pytest.approx(0.5, abs=0.2)


def test_the_reward_model_script_builds_a_model_that_learns_the_rule(tmp_path: Path) -> None:
    model, tokenizer = _script("make_tiny_rm").train(steps=250, seed=3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    _check_imitates_the_rule(tmp_path, min_corr=0.9, seed=8)


def test_the_numeric_reward_reads_the_arith_word_answers() -> None:
    rows = [json.loads(line) for line in (DATA / "arith_words_test.jsonl").read_text().splitlines()][:4]
    prompts = [row["prompt"] for row in rows]
    metadata = [{"answer": row["answer"]} for row in rows]
    reward = build_reward("numeric")
    assert list(reward.score(prompts, [row["solution"] for row in rows], metadata).total) == [1.0] * 4
    wrong = [f"#### {row['answer'] + 1}" for row in rows]
    assert list(reward.score(prompts, wrong, metadata).total) == [0.0] * 4
    last_number = [f"It is {row['answer']}." for row in rows]  # no marker: the last number counts
    assert list(reward.score(prompts, last_number, metadata).total) == [1.0] * 4
