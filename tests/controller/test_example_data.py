"""The example data files: questions.jsonl is usable as shipped, each generated file matches its script."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from rlfleet.controller.dataset import PromptDataset

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


def _load_script(name: str = "make_tiny_digits") -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DATA / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_questions_are_many_distinct_and_short(char_tokenizer: Any) -> None:
    rows = [json.loads(line) for line in (DATA / "questions.jsonl").read_text().splitlines()]
    prompts = [row["prompt"] for row in rows]
    assert len(prompts) >= 300
    assert len({p.strip().lower() for p in prompts}) == len(prompts)
    assert all(p.endswith("?") and len(p) < 200 for p in prompts)
    assert len({row["category"] for row in rows}) >= 8
    # The README snippet: built before the model is known, bound later by the trainer.
    dataset = PromptDataset(data_path=str(DATA / "questions.jsonl"), max_prompt_length=512, num_workers=2)
    dataset.bind_tokenizer(char_tokenizer)
    assert len(dataset) == len(prompts)  # nothing filtered as overlong
    assert dataset.steps_per_epoch(32) == len(prompts) // 32


def test_tiny_digits_file_matches_its_script(tmp_path: Path) -> None:
    script = _load_script()
    out = tmp_path / "tiny_digits.jsonl"
    script.write_jsonl(script.make_prompts(200, 0), out)
    assert out.read_bytes() == (DATA / "tiny_digits.jsonl").read_bytes()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len({row["prompt"] for row in rows}) == 200
    for row in rows:
        head, _, tail = row["prompt"].partition(" ")
        assert head in script.PREFIXES and tail.endswith(" ->")
        assert tail[: -len(" ->")].replace(" ", "") == row["digits"] and row["digits"].isdigit()


def test_tiny_digits_script_depends_only_on_seed() -> None:
    script = _load_script()
    assert script.make_prompts(20, 1) == script.make_prompts(20, 1)
    assert script.make_prompts(20, 0) != script.make_prompts(20, 1)


def test_tiny_prefs_file_matches_its_script(tmp_path: Path) -> None:
    script = _load_script("make_tiny_prefs")
    out = tmp_path / "tiny_prefs.jsonl"
    script.write_jsonl(script.make_pairs(256, 0), out)
    assert out.read_bytes() == (DATA / "tiny_prefs.jsonl").read_bytes()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(row["chosen"].isdigit() and row["rejected"].isalpha() for row in rows)
    assert all(len(row["chosen"]) == len(row["rejected"]) for row in rows)


def _solve(question: str) -> int:
    """The answer of a generated word problem, worked out from its wording alone."""
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    if "packs of" in question:
        have, packs, per, given = numbers
        return have + packs * per - given
    if "more." in question:
        return numbers[0] + numbers[1]
    if "gave" in question:
        return numbers[0] - numbers[1]
    if "in each bag" in question:
        return numbers[0] * numbers[1]
    assert "equally among" in question, question
    total, people = numbers
    assert total % people == 0, question
    return total // people


def test_arith_word_files_match_their_script(tmp_path: Path) -> None:
    script = _load_script("make_arith_words")
    train, test = script.make_splits(300, 60, 0)
    script.write_jsonl(train, tmp_path / "train.jsonl")
    script.write_jsonl(test, tmp_path / "test.jsonl")
    assert (tmp_path / "train.jsonl").read_bytes() == (DATA / "arith_words.jsonl").read_bytes()
    assert (tmp_path / "test.jsonl").read_bytes() == (DATA / "arith_words_test.jsonl").read_bytes()
    assert script.make_splits(20, 5, 1) == script.make_splits(20, 5, 1) != script.make_splits(20, 5, 2)


def test_arith_word_answers_are_right_and_the_held_out_split_is_new() -> None:
    script = _load_script("make_arith_words")
    train, test = script.make_splits(300, 60, 0)
    assert len(train) == 300 and len(test) == 60
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in test}
    kinds = set()
    for row in train + test:
        question = row["prompt"].removesuffix(" " + script.INSTRUCTION)
        assert question != row["prompt"] and question.endswith("?")
        assert isinstance(row["answer"], int) and row["answer"] == _solve(question) >= 0, row
        *steps, final = row["solution"].splitlines()
        assert final == f"#### {row['answer']}"
        for step in steps:  # each worked step is right: "12 + 7 = 19"
            left, right = step.split(" = ")
            assert re.fullmatch(r"\d+( [-+*/] \d+)+", left), step  # nothing but arithmetic to eval
            assert eval(left, {"__builtins__": {}}) == int(right), row
        kinds.add(next(word for word in ("packs", "more.", "gave", "bag", "equally") if word in question))
    assert len(kinds) == 5, kinds


def test_calc_problems_match_their_script_and_keep_held_out_apart(tmp_path: Path) -> None:
    """The SmolLM2 calculator task: the files are the script's, no held-out problem is trained on, and
    each answer is its problem's value."""
    script = _load_script("make_calc_problems")
    taken: set[str] = set()
    for name, count, seed in (("calc_problems", 256, 0), ("calc_problems_heldout", 64, 1)):
        out = tmp_path / f"{name}.jsonl"
        script.write_jsonl(script.problems(count, seed, taken), out)
        assert out.read_bytes() == (DATA / f"{name}.jsonl").read_bytes(), name
    train, held = ([json.loads(line) for line in (DATA / f"{n}.jsonl").read_text().splitlines()]
                   for n in ("calc_problems", "calc_problems_heldout"))  # fmt: skip
    question = re.compile(r"^What is (\d+) ([*+]) (\d+)\?$")
    asked = []
    for row in [*train, *held]:
        assert row["prompt"][:-1] == script.EXAMPLE and row["prompt"][-1]["role"] == "user"
        a, op, b = question.match(row["prompt"][-1]["content"]).groups()  # type: ignore[union-attr]
        assert row["answer"] == (int(a) * int(b) if op == "*" else int(a) + int(b))
        asked.append(row["prompt"][-1]["content"])
    assert len(set(asked)) == len(asked) == 320  # no problem twice, none both trained on and held out
