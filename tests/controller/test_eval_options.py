"""Evaluation options that follow the run's conventions: ``eval.max_tokens`` (the held-out answers'
length, checked against the rollout tier's context cap at load), and ``rlfleet eval``'s ``--split``
(read through ``datasets``), ``--chat-template`` and ``--trust-remote-code`` (loaded by the run's
tokenizer loader). In-process: the tokenizer, the prompts and the generation of a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlfleet.common.errors import ConfigError
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.errors import DatasetError
from rlfleet.controller.evaluation import EvalOptions, generate, load_model, load_prompts, prompt_source
from rlfleet.controller.models import resolve_model

MARKED = (
    "{% for m in messages %}Q: {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} A:{% endif %}"
)


def _write(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("tiny:digits", cache_dir=tmp_path_factory.mktemp("models"), seed=0)


def test_eval_max_tokens_is_128_and_must_fit_every_pool() -> None:
    assert TrainerConfig(eval={"data": "held.jsonl"}).eval.max_tokens == 128
    vllm = {"type": "vllm", "max_model_len": 160}
    lengths = {"max_prompt_length": 64, "max_response_length": 32, "rollout": {"engine": vllm}}
    assert TrainerConfig(eval={"data": "held.jsonl", "max_tokens": 96}, **lengths).eval.max_tokens == 96
    with pytest.raises(ValidationError) as refused:
        TrainerConfig(eval={"data": "held.jsonl", "max_tokens": 97}, **lengths)
    assert "eval.max_tokens (97) exceeds rollout.engine.max_model_len (160)" in str(refused.value)
    pools = {"small": {"workers": 1, "engine": {"type": "vllm", "max_model_len": 100}},
             "big": {"workers": 1, "engine": {"type": "vllm", "max_model_len": 4096}}}  # fmt: skip
    with pytest.raises(ValidationError, match=r"rollout\.pools\.small\.engine\.max_model_len \(100\)"):
        TrainerConfig(
            eval={"data": "held.jsonl"},
            max_prompt_length=64,
            max_response_length=32,
            rollout={"pools": pools},
        )
    # without eval.data nothing is answered at that length, so nothing is checked
    assert TrainerConfig(eval={"max_tokens": 4000}, **lengths).max_response_length == 32
    with pytest.raises(ValidationError, match=r"eval\.max_tokens"):
        TrainerConfig(eval={"data": "held.jsonl", "max_tokens": 0})


def test_split_reads_the_data_through_datasets(tmp_path: Path) -> None:
    folder = tmp_path / "splits"
    folder.mkdir()
    _write(folder / "train.jsonl", ["in: 1 ->", "in: 2 ->", "in: 3 ->"])
    _write(folder / "test.jsonl", ["in: 7 ->", "in: 8 ->"])
    test = load_prompts(EvalOptions(models=[], data=str(folder), split="test"))
    assert [test[i].prompt for i in range(len(test))] == ["in: 7 ->", "in: 8 ->"]
    part = load_prompts(EvalOptions(models=[], data=f"hf:{folder}", split="train[1:]"))
    assert [part[i].prompt for i in range(len(part))] == ["in: 2 ->", "in: 3 ->"]
    one_file = load_prompts(EvalOptions(models=[], data=str(folder / "train.jsonl"), split="train[:1]"))
    assert len(one_file) == 1 and one_file[0].prompt == "in: 1 ->"
    with pytest.raises(ConfigError, match="names its split already"):
        prompt_source(EvalOptions(models=[], data=f"hf:{folder}?split=test", split="train"))
    assert prompt_source(EvalOptions(models=[], data="hf:a/b?subset=main", split="test")) == (
        "hf:a/b?subset=main&split=test"
    )
    with pytest.raises(DatasetError, match="test"):
        load_prompts(EvalOptions(models=[], data=str(folder / "train.jsonl"), split="test"))


def test_chat_template_reaches_the_prompts_the_model_answers(tiny_dir: Path, tmp_path: Path) -> None:
    data = _write(tmp_path / "p.jsonl", ["in: 12 ->", "in: 345 ->"])
    options = EvalOptions(models=[], data=data, max_new_tokens=3)
    plain, _ = generate(tiny_dir, load_prompts(options), options)
    assert [item.text for item in plain] == ["in: 12 ->", "in: 345 ->"]  # the tiny model has no template
    template = tmp_path / "marked.jinja"
    template.write_text(MARKED)
    for setting in (MARKED, str(template)):
        options = EvalOptions(models=[], data=data, max_new_tokens=3, chat_template=setting)
        items, answers = generate(tiny_dir, load_prompts(options), options)
        assert [item.text for item in items] == ["Q: in: 12 -> A:", "Q: in: 345 -> A:"]
        # one token per character; a template writes its own special tokens (no BOS added)
        assert [len(item.token_ids or []) for item in items] == [len(item.text) for item in items]
        assert len(answers) == 2 and all(tokens <= 3 for ((_, tokens),) in answers)
    with pytest.raises(ConfigError, match="--chat-template"):
        load_model(tiny_dir, EvalOptions(models=[], data=data, chat_template="{% for %}"))
    with pytest.raises(ConfigError, match="--chat-template"):
        load_model(tiny_dir, EvalOptions(models=[], data=data, chat_template=str(tmp_path / "none.jinja")))
