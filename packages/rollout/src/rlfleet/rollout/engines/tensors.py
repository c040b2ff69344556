"""Pack engine completions into the rollout-batch tensor contract shared by rollout, reward and trainer.

N = number of completions (prompt-major, as ``Engine.generate`` returns them):

- ``prompt_ids`` (N, P) int64, left-padded with ``pad_token_id``; ``prompt_mask`` (N, P) int64
- ``response_ids`` (N, R) int64, right-padded; ``response_mask`` (N, R) int64 (a generated stop
  token counts as real); ``rollout_logprobs`` (N, R) float32, 0 at padding
- ``group_index`` (N,) int64: the prompt each sample answers
- ``prompt_text`` / ``response_text`` uint8 (total utf-8 bytes,) with ``*_offsets`` (N+1,) int64

Texts are packed with :func:`rlfleet.common.batch.pack_texts` (read back with ``unpack_texts``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from rlfleet.common.batch import pack_texts, pad_left, pad_right
from rlfleet.rollout.engines.base import Completion

logger = logging.getLogger(__name__)


def to_rollout_tensors(
    completions: Sequence[Completion], pad_token_id: int, tokenizer: Any | None = None
) -> dict[str, torch.Tensor]:
    """Pack completions (prompt-major) into the rollout-batch tensor dict described above.

    ``tokenizer`` decodes the prompts for ``prompt_text`` (``skip_special_tokens=True``, like the
    responses); without one, every prompt text is empty. ``response_text`` is each
    ``Completion.text``. Completions without logprobs get 0 over their whole response.
    """
    if not completions:
        raise ValueError("to_rollout_tensors needs at least one completion")
    for c in completions:
        if c.logprobs and len(c.logprobs) != len(c.token_ids):
            raise ValueError(
                f"completion (prompt {c.prompt_index}, sample {c.sample_index}) has {len(c.token_ids)} "
                f"tokens but {len(c.logprobs)} logprobs"
            )
    prompt_ids, prompt_mask = pad_left([c.prompt_token_ids for c in completions], pad_token_id)
    response_ids, response_mask = pad_right([c.token_ids for c in completions], pad_token_id, torch.int64)
    logprob_rows = [c.logprobs if c.logprobs else [0.0] * len(c.token_ids) for c in completions]
    logprobs, _ = pad_right(logprob_rows, 0.0, torch.float32)
    if tokenizer is not None:
        prompts = tokenizer.batch_decode([c.prompt_token_ids for c in completions], skip_special_tokens=True)
    else:
        prompts = [""] * len(completions)
    prompt_text, prompt_offsets = pack_texts(prompts)
    response_text, response_offsets = pack_texts([c.text for c in completions])
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "rollout_logprobs": logprobs,
        "group_index": torch.tensor([c.prompt_index for c in completions], dtype=torch.int64),
        "prompt_text": prompt_text,
        "prompt_text_offsets": prompt_offsets,
        "response_text": response_text,
        "response_text_offsets": response_offsets,
    }
