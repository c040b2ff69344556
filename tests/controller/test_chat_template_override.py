"""The ``chat_template`` setting: a Jinja string or a .jinja file that replaces the model's own
template in the run's tokenizer, so every prompt the run renders (``PromptDataset``) uses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.errors import ConfigError
from rlfleet.controller.dataset import PromptDataset
from rlfleet.controller.run_tokenizer import load_run_tokenizer
from rlfleet.controller.tokenizers import build_char_tokenizer

OWN = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
OVERRIDE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _model_dir(tmp_path: Path, template: str | None) -> Path:
    folder = tmp_path / ("with-template" if template else "plain")
    build_char_tokenizer(chat_template=template).save_pretrained(folder)
    return folder


def _rendered(tokenizer, data: Path) -> tuple[str, list[int]]:
    item = PromptDataset(data, tokenizer=tokenizer, shuffle=False)[0]
    assert item.token_ids is not None
    return item.text, item.token_ids


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "2+2?"}\n')
    return path


def test_an_override_replaces_the_models_template(tmp_path: Path, data: Path) -> None:
    folder = _model_dir(tmp_path, OWN)
    own_text, own_ids = _rendered(load_run_tokenizer(folder), data)
    assert own_text == "[user] 2+2?\n"
    text, ids = _rendered(load_run_tokenizer(folder, chat_template=OVERRIDE), data)
    assert text == "<user>2+2?|<assistant>"
    assert ids != own_ids and ids == build_char_tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_a_jinja_file_gives_a_model_without_one_a_template(tmp_path: Path, data: Path) -> None:
    folder = _model_dir(tmp_path, None)
    plain_text, plain_ids = _rendered(load_run_tokenizer(folder), data)
    assert plain_text == "2+2?"
    template = tmp_path / "template.jinja"
    template.write_text(OVERRIDE)
    text, ids = _rendered(load_run_tokenizer(folder, chat_template=str(template)), data)
    assert text == "<user>2+2?|<assistant>" and ids != plain_ids
    assert ids == build_char_tokenizer()(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("no/such/template.jinja", "neither a Jinja template"),
        ("{% for m in messages %}{{ m['content'] }}", "does not render"),
        ("{{ raise_exception('no') }}", "does not render"),
    ],
)
def test_a_bad_template_is_a_config_error(tmp_path: Path, setting: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as raised:
        load_run_tokenizer(_model_dir(tmp_path, None), chat_template=setting)
    assert raised.value.path == "chat_template"


def test_the_setting_is_part_of_the_config() -> None:
    from rlfleet.controller.config import TrainerConfig

    assert TrainerConfig().chat_template is None
    assert TrainerConfig(chat_template=OVERRIDE).chat_template == OVERRIDE
