"""PromptDataset rendering (chat templates, system prompts), tokenizing and the overlong policies."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rlfleet.controller.dataset import PromptDataset
from rlfleet.controller.errors import DatasetError

WriteRows = Callable[[list[dict[str, Any]]], Path]


def test_plain_prompt_without_template_is_raw_with_bos(jsonl_file: WriteRows, char_tokenizer: Any) -> None:
    ds = PromptDataset(jsonl_file([{"prompt": "Hi 5!"}]), tokenizer=char_tokenizer)
    item = ds[0]
    assert item.text == "Hi 5!"
    assert item.token_ids == char_tokenizer("Hi 5!")["input_ids"]
    assert item.token_ids[0] == char_tokenizer.bos_token_id
    assert len(item.token_ids) == 6


def test_string_and_messages_go_through_chat_template(jsonl_file: WriteRows, chat_tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "a?"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c?"},
    ]
    ds = PromptDataset(
        jsonl_file([{"prompt": "Hi"}, {"prompt": messages}]), tokenizer=chat_tokenizer, shuffle=False
    )
    assert ds[0].text == "<user>Hi\n<assistant>"
    assert ds[1].text == "<user>a?\n<assistant>b\n<user>c?\n<assistant>"
    # The template already is the whole prompt: no extra <bos> is added in front.
    assert ds[0].token_ids == chat_tokenizer(ds[0].text, add_special_tokens=False)["input_ids"]
    assert chat_tokenizer.bos_token_id not in ds[0].token_ids


def test_system_prompt(jsonl_file: WriteRows, chat_tokenizer: Any, char_tokenizer: Any) -> None:
    rows = [
        {"prompt": "Hi"},
        {"prompt": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Yo"}]},
    ]
    ds = PromptDataset(jsonl_file(rows), tokenizer=chat_tokenizer, system_prompt="Be brief.", shuffle=False)
    assert ds[0].text == "<system>Be brief.\n<user>Hi\n<assistant>"
    assert ds[1].text == "<system>Own.\n<user>Yo\n<assistant>"  # a row's own system message wins
    raw = PromptDataset(jsonl_file(rows[:1]), tokenizer=char_tokenizer, system_prompt="Be brief.")
    assert raw[0].text == "Be brief.\nHi"


def test_apply_chat_template_off(jsonl_file: WriteRows, chat_tokenizer: Any) -> None:
    ds = PromptDataset(jsonl_file([{"prompt": "Hi"}]), tokenizer=chat_tokenizer, apply_chat_template=False)
    assert ds[0].text == "Hi"
    assert ds[0].token_ids == chat_tokenizer("Hi")["input_ids"]
    with pytest.raises(DatasetError, match="row 0: a chat-message prompt needs a chat template"):
        PromptDataset(
            jsonl_file([{"prompt": [{"role": "user", "content": "Hi"}]}]),
            tokenizer=chat_tokenizer,
            apply_chat_template=False,
        )


def test_messages_need_a_bound_tokenizer(jsonl_file: WriteRows, chat_tokenizer: Any) -> None:
    ds = PromptDataset(jsonl_file([{"prompt": [{"role": "user", "content": "Hi"}]}] * 3))
    assert len(ds) == 3
    with pytest.raises(DatasetError, match="bind_tokenizer"):
        ds.next_batch(1)
    ds.bind_tokenizer(chat_tokenizer)
    assert ds.tokenizer is chat_tokenizer
    assert [it.text for it in ds.next_batch(2)] == ["<user>Hi\n<assistant>"] * 2


def test_threads_and_late_binding_give_the_same_items(tmp_path: Path, char_tokenizer: Any) -> None:
    path = tmp_path / "many.jsonl"
    path.write_text("".join(f'{{"prompt": "question {i} {"x" * (i % 7)}", "i": {i}}}\n' for i in range(101)))
    early = PromptDataset(path, tokenizer=char_tokenizer, num_workers=1)
    late = PromptDataset(path, num_workers=3)
    late.bind_tokenizer(char_tokenizer)
    assert [early[i] for i in range(101)] == [late[i] for i in range(101)]
    assert [late[i].metadata["i"] for i in range(101)] == list(range(101))


def test_overlong_filter_drops_and_logs(
    jsonl_file: WriteRows, char_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [{"prompt": "x" * n, "n": n} for n in (3, 20, 9, 10, 30)]  # +1 token for <bos>
    with caplog.at_level(logging.WARNING, logger="rlfleet.controller.dataset"):
        ds = PromptDataset(jsonl_file(rows), max_prompt_length=10, tokenizer=char_tokenizer, shuffle=False)
    assert [ds[i].metadata["n"] for i in range(len(ds))] == [3, 9]
    assert "filtered out 3 overlong prompts" in caplog.text


def test_overlong_truncate_keeps_the_end(jsonl_file: WriteRows, char_tokenizer: Any) -> None:
    ds = PromptDataset(
        jsonl_file([{"prompt": "abcdefghij"}, {"prompt": "ab"}]),
        max_prompt_length=4,
        tokenizer=char_tokenizer,
        overlong="truncate",
        shuffle=False,
    )
    assert len(ds) == 2
    assert ds[0].text == "ghij" and ds[0].truncated
    assert ds[0].token_ids == char_tokenizer("ghij", add_special_tokens=False)["input_ids"]
    assert ds[1].text == "ab" and not ds[1].truncated
    assert ds[1].token_ids[0] == char_tokenizer.bos_token_id


def test_overlong_error_and_all_filtered(jsonl_file: WriteRows, char_tokenizer: Any) -> None:
    path = jsonl_file([{"prompt": "short"}, {"prompt": "much too long"}])
    with pytest.raises(
        DatasetError, match=r"1 prompts are longer than max_prompt_length=8 tokens \(first: row 1"
    ):
        PromptDataset(path, max_prompt_length=8, tokenizer=char_tokenizer, overlong="error")
    with pytest.raises(DatasetError, match="every prompt is longer than max_prompt_length=2"):
        PromptDataset(path, max_prompt_length=2, tokenizer=char_tokenizer)


def test_bad_arguments(jsonl_file: WriteRows) -> None:
    path = jsonl_file([{"prompt": "Hi"}])
    with pytest.raises(ValueError, match="overlong must be one of"):
        PromptDataset(path, overlong="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_prompt_length must be >= 1"):
        PromptDataset(path, max_prompt_length=0)
