"""Fixtures for controller tests: character tokenizers (with and without a chat template), data files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rlfleet.controller.tokenizers import build_char_tokenizer

# A tiny ChatML-like template: each message as "<role>content\n", then "<assistant>" to answer.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="session")
def char_tokenizer() -> Any:
    """Character tokenizer without a chat template (adds <bos> in front)."""
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def chat_tokenizer() -> Any:
    """Character tokenizer with ``CHAT_TEMPLATE``."""
    return build_char_tokenizer(chat_template=CHAT_TEMPLATE)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def jsonl_file(tmp_path: Path) -> Callable[[list[dict[str, Any]]], Path]:
    """Write rows to ``tmp_path/data.jsonl`` and return the path."""
    return lambda rows: write_jsonl(tmp_path / "data.jsonl", rows)
