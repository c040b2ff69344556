"""The run's tokenizer: the actor's, loaded as the run's settings say, with its chat template.

Only the controller renders prompts (the other tiers receive token ids), so the ``chat_template``
override is applied here, once, to the tokenizer every prompt dataset of the run binds: a Jinja
string, or the path of a ``.jinja`` file. ``trust_remote_code`` reaches ``AutoTokenizer`` here as
it reaches every other tier's loaders.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.common.errors import ConfigError
from rlfleet.common.remote_code import refused_remote_code, remote_code_reason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

JINJA_MARKS = ("{{", "{%")
"""A setting holding either is a template itself; anything else names a file."""
PROBE = [{"role": "user", "content": "Hi"}]


def read_chat_template(setting: str) -> str:
    """The Jinja text of the ``chat_template`` setting: itself, or the contents of the file it names."""
    if any(mark in setting for mark in JINJA_MARKS):
        return setting
    path = Path(setting).expanduser()
    if not path.is_file():
        raise ConfigError(
            "chat_template", setting, "neither a Jinja template (no '{{' or '{%') nor an existing file; "
            "give the template text or the path of a .jinja file",
        )  # fmt: skip
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("chat_template", setting, f"cannot read it: {exc}") from exc
    if not text.strip():
        raise ConfigError("chat_template", setting, "the file is empty")
    return text


def override_chat_template(tokenizer: PreTrainedTokenizerBase, setting: str) -> None:
    """Give ``tokenizer`` the template of ``setting``, checked by rendering one user message."""
    template = read_chat_template(setting)
    try:
        rendered = tokenizer.apply_chat_template(
            PROBE, chat_template=template, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # noqa: BLE001 - Jinja syntax and render errors of every kind
        raise ConfigError("chat_template", setting, f"does not render: {type(exc).__name__}: {exc}") from exc
    if not isinstance(rendered, str) or not rendered:
        raise ConfigError("chat_template", setting, "renders a user message as nothing")
    tokenizer.chat_template = template


def load_run_tokenizer(
    model_dir: str | os.PathLike[str], *, trust_remote_code: bool = False, chat_template: str | None = None
) -> PreTrainedTokenizerBase:
    """``AutoTokenizer`` of ``model_dir`` (``trust_remote_code`` passed on), with ``chat_template``
    in place of its own when set."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(model_dir), trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if refused_remote_code(exc):
            raise ConfigError("trust_remote_code", False, remote_code_reason(model_dir)) from None
        raise
    if chat_template is not None:
        override_chat_template(tokenizer, chat_template)
        logger.info("prompts use the chat template of chat_template, not the model's")
    return tokenizer
