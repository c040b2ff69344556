"""Random rollout batches in the contract's layout, and a policy update on given advantages, for the
trainer tests and their rank scripts.

Plain module (the rank scripts run as ``python checkpoint_ranks.py`` and import it from their
folder; conftest puts this folder on ``sys.path`` for the tests).
"""

from __future__ import annotations

from typing import Any

import torch

from rlfleet.common.schema.trainer import BatchSettings, StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.grpo import policy_plan
from rlfleet.trainer.loop import train_loop

VOCAB = 64


def update(
    actor: Actor, batch: dict[str, torch.Tensor], advantages: torch.Tensor, *, num_updates: int = 1,
    **settings: Any,
) -> dict:  # fmt: skip
    """The policy's steps on ``batch`` and ``advantages`` through the update loop, in ``num_updates``
    mini-batches, with ``settings`` (the ``update`` section's fields; no KL term unless ``kl_coef``
    is given)."""
    step = StepSettings(
        update=UpdateSettings(**{"kl_coef": 0.0, **settings}),
        batch=BatchSettings(rollout_batch_size=num_updates, train_batch_size=1),
    )
    return train_loop(policy_plan(actor, batch, advantages, step))


def contract_batch(
    prompt_lens: list[int], response_lens: list[int], *, seed: int = 0, pad_id: int = 0, vocab: int = VOCAB
) -> dict[str, torch.Tensor]:
    """Prompts left-padded to the longest, responses right-padded to the longest (token ids 3..vocab-1),
    ``group_index`` pairing consecutive rows."""
    gen = torch.Generator().manual_seed(seed)
    n, p, r = len(prompt_lens), max(prompt_lens), max(response_lens)
    batch = {
        "prompt_ids": torch.full((n, p), pad_id, dtype=torch.int64),
        "prompt_mask": torch.zeros((n, p), dtype=torch.int64),
        "response_ids": torch.full((n, r), pad_id, dtype=torch.int64),
        "response_mask": torch.zeros((n, r), dtype=torch.int64),
    }
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        batch["prompt_ids"][i, p - pl :] = torch.randint(3, vocab, (pl,), generator=gen)
        batch["prompt_mask"][i, p - pl :] = 1
        batch["response_ids"][i, :rl] = torch.randint(3, vocab, (rl,), generator=gen)
        batch["response_mask"][i, :rl] = 1
    batch["group_index"] = torch.arange(n) // 2
    return batch
