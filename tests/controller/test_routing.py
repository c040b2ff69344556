"""Hybrid rollout routing, unit layer: what a rollout fn's answers mean, and the batch of fn-written texts."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

from rlfleet.common.schema.batch import unpack_texts
from rlfleet.controller.dataset import PromptItem
from rlfleet.controller.routing import (
    ANY,
    TEXT,
    Pool,
    Response,
    RouteError,
    import_rollout_fn,
    plan_routes,
    text_batch,
)

POOLS = ["short", "long"]


def _items(char_tokenizer: Any, texts: list[str]) -> list[PromptItem]:
    return [PromptItem(i * 10, t, char_tokenizer(t)["input_ids"]) for i, t in enumerate(texts)]


def test_a_fn_routes_by_length_answers_some_itself_and_leaves_others_to_any_pool(char_tokenizer) -> None:
    batch = _items(char_tokenizer, ["hi", "a much longer prompt", "skip me", "say 7", "ok"])

    def route(item: PromptItem) -> Any:
        if item.text == "skip me":
            return None
        if item.text.startswith("say "):
            return item.text[4:]
        return "long" if len(item.token_ids) > 8 else Pool("short")

    plan = plan_routes(route, batch, POOLS, n=3)
    assert plan.routes == {"short": [0, 4], "long": [1], ANY: [2], TEXT: [3]}
    assert plan.texts == {3: ["7", "7", "7"]}


def test_without_a_fn_every_prompt_goes_to_any_pool(char_tokenizer) -> None:
    plan = plan_routes(None, _items(char_tokenizer, ["a", "b"]), POOLS, n=2)
    assert plan.routes == {ANY: [0, 1]} and plan.texts == {}


def test_texts_per_sample_and_a_text_that_equals_a_pool_name(char_tokenizer) -> None:
    batch = _items(char_tokenizer, ["one", "two"])
    answers = {"one": ["x", "yy"], "two": Response("short")}
    plan = plan_routes(lambda item: answers[item.text], batch, POOLS, n=2)
    assert plan.routes == {TEXT: [0, 1]}
    assert plan.texts == {0: ["x", "yy"], 1: ["short", "short"]}


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (Pool("medium"), r"no rollout pool 'medium'; the pools are \['long', 'short'\]"),
        (["only one"], r"returned 1 responses; a prompt takes group_size=2"),
        (42, r"expected a pool name, None or response text\(s\), got int"),
        (Response([1, 2]), r"expected a pool name, None or response text\(s\), got list"),
    ],
)
def test_unusable_answers_name_the_prompt_and_the_problem(char_tokenizer, answer: Any, message: str) -> None:
    batch = _items(char_tokenizer, ["first", "second"])
    with pytest.raises(RouteError, match=r"prompt row 10 \('second'\): " + message):
        plan_routes(lambda item: "short" if item.index == 0 else answer, batch, POOLS, n=2)


def test_a_fn_that_raises_is_reported_with_its_prompt(char_tokenizer) -> None:
    def broken(item: PromptItem) -> str:
        raise KeyError("difficulty")

    with pytest.raises(RouteError, match=r"prompt row 0 \('hi'\): it raised KeyError: 'difficulty'") as info:
        plan_routes(broken, _items(char_tokenizer, ["hi"]), POOLS, n=1)
    assert info.value.row == 0


def test_a_near_miss_of_a_pool_name_is_used_as_text_with_a_warning(char_tokenizer, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="rlfleet.controller.routing"):
        plan = plan_routes(lambda item: "shorts", _items(char_tokenizer, ["hi"]), POOLS, n=1)
    assert plan.routes == {TEXT: [0]}
    assert "'shorts', close to a pool name" in caplog.text and "Pool(name)" in caplog.text


def test_text_batch_follows_the_rollout_contract(char_tokenizer) -> None:
    items = _items(char_tokenizer, ["q1", "longer q2"])
    texts = [["12", "3"], ["abcdefgh", ""]]
    tensors, num_tokens = text_batch(items, texts, char_tokenizer, max_response_length=5)
    eos, pad = char_tokenizer.eos_token_id, char_tokenizer.pad_token_id

    assert tensors["group_index"].tolist() == [0, 0, 1, 1]
    assert tensors["prompt_ids"].shape == (4, len(items[1].token_ids))
    assert tensors["prompt_ids"][0, -len(items[0].token_ids) :].tolist() == items[0].token_ids
    assert tensors["prompt_mask"][0].tolist() == [0] * 7 + [1] * 3  # left-padded
    ids = tensors["response_ids"].tolist()
    enc = lambda t: char_tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert ids[0] == [*enc("12"), eos, pad, pad]
    assert ids[1] == [*enc("3"), eos, pad, pad, pad]
    assert ids[2] == enc("abcde"), "cut at max_response_length: no EOS"
    assert ids[3] == [eos, pad, pad, pad, pad], "an empty text is just EOS"
    assert tensors["response_mask"].sum(dim=1).tolist() == [3, 2, 5, 1]
    assert num_tokens == 11

    logprobs, mask = tensors["rollout_logprobs"], tensors["response_mask"].bool()
    assert logprobs.dtype == torch.float32 and torch.isnan(logprobs[mask]).all()
    assert (logprobs[~mask] == 0).all()
    responses = unpack_texts(tensors["response_text"], tensors["response_text_offsets"])
    assert responses == ["12", "3", "abcde", ""]
    assert unpack_texts(tensors["prompt_text"], tensors["prompt_text_offsets"]) == [
        "q1",
        "q1",
        *["longer q2"] * 2,
    ]


def test_import_rollout_fn_names_what_is_wrong() -> None:
    from rlfleet.common.errors import ConfigError

    assert import_rollout_fn("math:floor") is math.floor
    with pytest.raises(ConfigError, match="expected 'package.module:function'"):
        import_rollout_fn("math.floor")
    with pytest.raises(ConfigError, match="cannot import it"):
        import_rollout_fn("no_such_module_xyz:route")
    with pytest.raises(ConfigError, match="float is not callable"):
        import_rollout_fn("math:pi")
