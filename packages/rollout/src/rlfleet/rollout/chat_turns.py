"""An environment's observation as the tokens an episode appends after the model's turn.

Token in, token out: an episode's context is never re-tokenised. After each model turn the rollout
worker appends only the tokens of what comes next: the end of the model's turn, the observation
as a chat turn of its role (``tool`` or ``user``), and the assistant generation prompt. They are
rendered with the tokenizer's chat template on a fixed dummy conversation: the text that follows
the dummy assistant turn's content in ``[user, assistant, observation]`` (with the generation
prompt) is the delta, tokenised on its own. The delta is used only where the template's tokens of
the whole conversation split exactly at that point (the same tokens either way); otherwise, or
without a chat template (the tests' character tokenizer), the observation is the plain text
``"\\n<role>: <observation>\\n"``.

A turn the model ended on a stop token keeps it (it was sampled); when that token is also the
first of the delta (the template's end of turn, e.g. ``<|im_end|>``), the delta goes on after it.
A turn cut at its length gets the template's whole end of turn.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

DUMMY_USER = {"role": "user", "content": "What is 2 + 2?"}
DUMMY_ASSISTANT = {"role": "assistant", "content": "The answer is 4."}
"""The fixed conversation an observation's turn is rendered after."""


class ChatTurns:
    """Renders observation turns for one tokenizer (a ``transformers`` tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self._warned = False

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, no special tokens added (a rendered template holds its own)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def cut(self, text: str, max_tokens: int) -> tuple[str, int]:
        """``text`` cut after its first ``max_tokens`` tokens, and how many tokens were cut off."""
        ids = self.encode(text)
        if len(ids) <= max_tokens:
            return text, 0
        if getattr(self.tokenizer, "is_fast", False):
            spans = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return text[: spans["offset_mapping"][max_tokens - 1][1]], len(ids) - max_tokens
        return self.tokenizer.decode(ids[:max_tokens]), len(ids) - max_tokens

    def observation(self, text: str, role: str, turn: Sequence[int], stopped: bool) -> list[int]:
        """The tokens to append after a model turn ``turn`` (its sampled ids; ``stopped``: it ended on a
        stop token) for an observation ``text`` of ``role``, up to the next assistant turn's start."""
        delta = self._templated(text, role) if self.templated else None
        if delta is None:
            return self.encode(f"\n{role}: {text}\n")
        if stopped and turn and delta and turn[-1] == delta[0]:
            return delta[1:]  # the model closed its turn itself: its stop token is the template's
        return delta

    def _templated(self, text: str, role: str) -> list[int] | None:
        """The template's tokens after the dummy assistant content, or None where it has no clean split."""
        from jinja2 import TemplateError  # what chat templates raise (transformers renders them with jinja2)

        messages = [DUMMY_USER, DUMMY_ASSISTANT, {"role": role, "content": text}]
        try:
            whole = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except (TemplateError, ValueError) as exc:
            return self._plain(f"the chat template refused a {role} turn ({exc})")
        content = DUMMY_ASSISTANT["content"]
        at = whole.find(content)
        if at < 0:
            return self._plain("the chat template rewrote the assistant's content")
        split = at + len(content)
        head, delta = self.encode(whole[:split]), self.encode(whole[split:])
        if head + delta != self.encode(whole):
            return self._plain("the template's tokens do not split at the end of the assistant's turn")
        return delta

    def _plain(self, why: str) -> None:
        if not self._warned:
            logger.warning("observations rendered as plain text, not with the chat template: %s", why)
            self._warned = True
