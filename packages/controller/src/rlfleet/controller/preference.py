"""Preference pairs for DPO: a prompt with a chosen and a rejected response, tokenized and batched.

A ``PreferenceDataset`` is a :class:`~rlfleet.controller.dataset.PromptDataset` (same file formats,
seeded epochs, resumable position, chat template on the prompt when the tokenizer has one) whose
rows also hold ``chosen`` and ``rejected`` responses::

    {"prompt": "q: 4 7 ->", "chosen": "47", "rejected": "ab"}
    {"prompt": [{"role": "user", "content": "..."}], "chosen": "...", "rejected": "..."}

A response is a string, or a message list whose last message is the assistant's (its content is
the response). Responses are tokenized without special tokens, end with the EOS token and are cut
to ``max_response_length`` tokens. :meth:`PreferenceDataset.collate` turns a batch into the
preference-batch tensors the trainer takes (``rlfleet.common.schema.batch``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from rlfleet.common.schema.batch import collate_pairs
from rlfleet.controller.dataset import Overlong, PromptDataset, PromptItem, _Row
from rlfleet.controller.errors import DatasetError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class PreferenceDataset(PromptDataset):
    """(prompt, chosen, rejected) rows from one file, tokenized for one tokenizer, in seeded epochs."""

    def __init__(
        self,
        data_path: str | os.PathLike[str],
        max_prompt_length: int = 512,
        max_response_length: int = 512,
        num_workers: int = 1,
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        seed: int = 0,
        tokenizer: PreTrainedTokenizerBase | str | os.PathLike[str] | None = None,
        shuffle: bool = True,
        overlong: Overlong = "filter",
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
    ) -> None:
        if max_response_length < 1:
            raise ValueError(f"max_response_length must be >= 1, got {max_response_length}")
        self.chosen_key = chosen_key
        self.rejected_key = rejected_key
        self.max_response_length = max_response_length
        self._responses: dict[int, list[list[int]]] = {}
        self._pad_id = 0
        super().__init__(
            data_path, max_prompt_length=max_prompt_length, num_workers=num_workers, prompt_key=prompt_key,
            seed=seed, tokenizer=tokenizer, shuffle=shuffle, overlong=overlong,
            apply_chat_template=apply_chat_template, system_prompt=system_prompt,
        )  # fmt: skip

    def _load_rows(self) -> list[_Row]:
        rows = super()._load_rows()
        for row in rows:
            for key in (self.chosen_key, self.rejected_key):
                self._response_text(row.index, row.metadata, key)
        return rows

    def _response_text(self, index: int, record: dict[str, Any], key: str) -> str:
        """The response under ``key``: a non-empty string, or the content of a final assistant message."""
        if key not in record:
            raise DatasetError(self.data_path, f"row {index} has no {key!r} column (it has {sorted(record)})")
        value = record[key]
        if isinstance(value, list) and value and isinstance(value[-1], dict):
            last = value[-1]
            if last.get("role") == "assistant" and isinstance(last.get("content"), str):
                value = last["content"]
        if not isinstance(value, str) or not value:
            raise DatasetError(
                self.data_path,
                f"row {index}: {key!r} must be a non-empty string or end with an assistant message, "
                f"got {value!r:.80}",
            )
        return value

    def bind_tokenizer(self, tokenizer: PreTrainedTokenizerBase | str | os.PathLike[str]) -> None:
        """Render and tokenize the prompts (as :class:`PromptDataset`), then both responses of each row."""
        super().bind_tokenizer(tokenizer)
        tok = self.tokenizer
        assert tok is not None
        eos = tok.eos_token_id
        pad = tok.pad_token_id
        self._pad_id = int(pad if pad is not None else (eos if eos is not None else 0))
        items = self._require_items()
        chosen = self._encode_responses(tok, items, self.chosen_key, eos)
        rejected = self._encode_responses(tok, items, self.rejected_key, eos)
        self._responses = {item.index: pair for item, *pair in zip(items, chosen, rejected, strict=True)}

    def _encode_responses(
        self, tokenizer: PreTrainedTokenizerBase, items: list[PromptItem], key: str, eos: int | None
    ) -> list[list[int]]:
        """Token ids of each item's response under ``key``: no special tokens, EOS appended, cut."""
        texts = [self._response_text(item.index, item.metadata, key) for item in items]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        tail = [eos] if eos is not None else []
        return [(list(tokens) + tail)[: self.max_response_length] for tokens in ids]

    def responses(self, item: PromptItem) -> tuple[list[int], list[int]]:
        """Token ids of ``item``'s chosen and rejected responses (EOS-terminated, cut to length)."""
        if item.index not in self._responses:
            raise DatasetError(self.data_path, "bind a tokenizer before asking for response tokens")
        chosen, rejected = self._responses[item.index]
        return chosen, rejected

    def collate(self, items: list[PromptItem]) -> dict[str, torch.Tensor]:
        """The preference-batch tensors of ``items`` (the contract's
        :func:`~rlfleet.common.schema.batch.collate_pairs`: prompts left-padded, responses right-padded).

        Returns:
            ``prompt_ids``/``prompt_mask`` (N, P), ``chosen_ids``/``chosen_mask`` (N, C),
            ``rejected_ids``/``rejected_mask`` (N, J), int64.
        """
        if not items:
            raise ValueError("collate needs at least one item")
        pairs = [self.responses(item) for item in items]
        prompts = [list(item.token_ids or []) for item in items]
        return collate_pairs(prompts, [c for c, _ in pairs], [r for _, r in pairs], self._pad_id)
