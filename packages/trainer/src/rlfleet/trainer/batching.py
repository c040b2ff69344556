"""Merge rollout chunks from several workers into one training batch.

Chunks come from different rollout workers, so their prompt and response widths differ and their
``group_index`` values restart at 0. Merging pads prompts on the left and responses on the right
(masks mark the padding) and offsets group indices so every prompt keeps its own group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlfleet.trainer.errors import InvalidBatch

TRAIN_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs", "group_index")


def _pad(t: Tensor, width: int, left: bool, value: float = 0) -> Tensor:
    extra = width - t.shape[1]
    if extra == 0:
        return t
    pad = torch.full((t.shape[0], extra), value, dtype=t.dtype)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


def merge_rollouts(chunks: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Concatenate rollout chunks (batch contract) into one batch: (N_total, P_max) and (N_total, R_max)."""
    if not chunks:
        raise InvalidBatch("rollouts", "a train step needs at least one rollout chunk")
    for i, chunk in enumerate(chunks):
        missing = [k for k in TRAIN_KEYS if k not in chunk]
        if missing:
            raise InvalidBatch(missing[0], f"rollout chunk {i} lacks {missing}")
    p_width = max(c["prompt_ids"].shape[1] for c in chunks)
    r_width = max(c["response_ids"].shape[1] for c in chunks)
    merged: dict[str, list[Tensor]] = {k: [] for k in TRAIN_KEYS}
    offset = 0
    for chunk in chunks:
        merged["prompt_ids"].append(_pad(chunk["prompt_ids"], p_width, left=True))
        merged["prompt_mask"].append(_pad(chunk["prompt_mask"], p_width, left=True))
        merged["response_ids"].append(_pad(chunk["response_ids"], r_width, left=False))
        merged["response_mask"].append(_pad(chunk["response_mask"], r_width, left=False))
        merged["rollout_logprobs"].append(_pad(chunk["rollout_logprobs"], r_width, left=False))
        groups = chunk["group_index"].long()
        merged["group_index"].append(groups + offset)
        offset += int(groups.max().item()) + 1 if groups.numel() else 0
    return {k: torch.cat(v) for k, v in merged.items()}
