"""Turning a rollout batch (see the batch contract) into the policy's forward inputs.

The training sequence of a sample is ``prompt (left-padded) ++ response (right-padded)``, so every
row has length T = P + R and its response starts at column P. Position ids come from the cumulative
sum of the attention mask, which makes left padding invisible to the model: a prompt padded to
any width gives the same logprobs as the unpadded prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from rlfleet.trainer.errors import InvalidBatch

logger = logging.getLogger(__name__)

TOKEN_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
"""Batch fields every update needs; ``rollout_logprobs`` and ``group_index`` are optional."""


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) 0/1 mask -> (B, T) int64 positions: 0 at the first real token; padding gets 0."""
    positions = attention_mask.long().cumsum(dim=-1) - 1
    return positions.clamp(min=0)


def validate_batch(batch: Mapping[str, Tensor]) -> None:
    """Raise :class:`InvalidBatch` unless the token fields are present and shaped (N, P) / (N, R)."""
    for key in TOKEN_KEYS:
        if key not in batch:
            raise InvalidBatch(key, f"missing; a rollout batch needs {', '.join(TOKEN_KEYS)}")
        if batch[key].ndim != 2:
            raise InvalidBatch(key, f"expected 2 dims (N, L), got shape {tuple(batch[key].shape)}")
    n = batch["prompt_ids"].shape[0]
    pairs = (("prompt_mask", "prompt_ids"), ("response_mask", "response_ids"))
    for mask_key, ids_key in pairs:
        if batch[mask_key].shape != batch[ids_key].shape:
            raise InvalidBatch(
                mask_key, f"shape {tuple(batch[mask_key].shape)} != {ids_key} {tuple(batch[ids_key].shape)}"
            )
    if batch["response_ids"].shape[0] != n:
        raise InvalidBatch("response_ids", f"{batch['response_ids'].shape[0]} rows, prompt_ids has {n}")
    rollout = batch.get("rollout_logprobs")
    if rollout is not None and rollout.shape != batch["response_ids"].shape:
        raise InvalidBatch(
            "rollout_logprobs",
            f"shape {tuple(rollout.shape)} != response_ids {tuple(batch['response_ids'].shape)}",
        )


@dataclass(frozen=True)
class PolicyInputs:
    """Forward inputs of a batch of N samples, prompt length P and response length R.

    Attributes:
        input_ids: (N, P + R) int64, prompt then response.
        attention_mask: (N, P + R) int64.
        position_ids: (N, P + R) int64, cumsum of the mask.
        response_mask: (N, R) int64, 1 for generated tokens.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_mask: Tensor

    @property
    def response_len(self) -> int:
        """R, the response width."""
        return self.response_mask.shape[1]

    @property
    def num_samples(self) -> int:
        """N."""
        return self.input_ids.shape[0]

    def select(self, rows: Tensor) -> PolicyInputs:
        """The sub-batch of ``rows`` (K,), with columns of left padding shared by all its rows dropped."""
        mask = self.attention_mask[rows]
        real_cols = mask.any(dim=0).nonzero()
        start = int(real_cols[0].item()) if real_cols.numel() else 0
        start = min(start, mask.shape[1] - self.response_len)
        return PolicyInputs(
            input_ids=self.input_ids[rows, start:],
            attention_mask=mask[:, start:],
            position_ids=self.position_ids[rows, start:],
            response_mask=self.response_mask[rows],
        )

    def to(self, device: torch.device | str) -> PolicyInputs:
        """A copy on ``device``."""
        return PolicyInputs(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            response_mask=self.response_mask.to(device),
        )


def build_policy_inputs(batch: Mapping[str, Tensor]) -> PolicyInputs:
    """Concatenate prompt and response of a contract batch into :class:`PolicyInputs` (same device)."""
    validate_batch(batch)
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1).long()
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).long()
    return PolicyInputs(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        response_mask=batch["response_mask"].long(),
    )
