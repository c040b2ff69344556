"""PreferenceDataset: reading pairs, the chat template on the prompt, response tokens, collating."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.controller import PreferenceDataset
from rlfleet.controller.errors import DatasetError

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"prompt": "q: 1 2 ->", "chosen": "12", "rejected": "ab"},
    {"prompt": "n: 7 ->", "chosen": [{"role": "assistant", "content": "7"}], "rejected": "xyz"},
]


def test_pairs_tokenize_and_collate_to_the_contract(
    jsonl_file: Callable[..., Path], char_tokenizer: Any
) -> None:
    data = PreferenceDataset(jsonl_file(ROWS), tokenizer=char_tokenizer, shuffle=False)
    eos, pad = char_tokenizer.eos_token_id, char_tokenizer.pad_token_id
    chosen, rejected = data.responses(data[1])
    assert chosen == [*char_tokenizer("7", add_special_tokens=False)["input_ids"], eos]
    assert rejected == [*char_tokenizer("xyz", add_special_tokens=False)["input_ids"], eos]
    batch = data.collate([data[0], data[1]])
    assert data[0].token_ids == char_tokenizer("q: 1 2 ->")["input_ids"]  # plain prompt: <bos> first
    assert batch["prompt_ids"].shape == (2, len(data[0].token_ids)) and batch["chosen_ids"].shape == (2, 3)
    assert batch["prompt_ids"][1, 0] == pad and batch["prompt_mask"][1, 0] == 0  # left padding
    assert batch["chosen_mask"].tolist() == [[1, 1, 1], [1, 1, 0]] and batch["rejected_mask"].sum() == 7
    assert all(t.dtype == torch.int64 for t in batch.values())


def test_the_chat_template_goes_on_the_prompt_only(
    jsonl_file: Callable[..., Path], chat_tokenizer: Any
) -> None:
    data = PreferenceDataset(jsonl_file(ROWS), tokenizer=chat_tokenizer, shuffle=False)
    assert data[0].text == "<user>q: 1 2 ->\n<assistant>"
    assert data.responses(data[0])[0][0] == chat_tokenizer.convert_tokens_to_ids("1")


def test_long_responses_are_cut(jsonl_file: Callable[..., Path], char_tokenizer: Any) -> None:
    rows = [{"prompt": "p", "chosen": "123456", "rejected": "a"}]
    data = PreferenceDataset(jsonl_file(rows), tokenizer=char_tokenizer, max_response_length=3)
    assert len(data.responses(data[0])[0]) == 3


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"prompt": "p", "chosen": "a"}, "no 'rejected' column"),
        ({"prompt": "p", "chosen": "", "rejected": "b"}, "'chosen' must be a non-empty string"),
        ({"prompt": "p", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "assistant message"),
    ],
)
def test_bad_rows_name_the_problem(jsonl_file: Callable[..., Path], row: dict[str, Any], needle: str) -> None:
    with pytest.raises(DatasetError, match=needle):
        PreferenceDataset(jsonl_file([row]))


def test_the_example_pairs_are_what_the_script_makes() -> None:
    spec = importlib.util.spec_from_file_location(
        "make_tiny_prefs", REPO / "examples" / "data" / "make_tiny_prefs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.make_pairs()
    text = "".join(json.dumps(row) + "\n" for row in rows)
    assert (REPO / "examples" / "data" / "tiny_prefs.jsonl").read_text() == text
    assert all(r["chosen"].isdigit() and r["rejected"].isalpha() for r in rows)
