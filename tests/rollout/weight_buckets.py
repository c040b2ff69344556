"""Weights as a trainer publishes them, for the engines' load tests: the state dict cut into buckets.

The wire contract the rollout tier loads (``{HF name: tensor}`` dicts, state-dict order, a tied
alias sent once under its first name) made from the model here, so that ``tests/rollout`` needs
only rlfleet-rollout; the trainer's own buckets meet the engines in tests/integration.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def weight_buckets(model: torch.nn.Module, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """``model``'s weights in buckets of at most ``bucket_bytes`` (a bigger tensor alone in its own),
    each tensor a detached copy; ``lm_head.weight`` tied to the embedding is left out, as trainers do."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    storages: set[int] = set()
    for name, tensor in model.state_dict().items():
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages:  # a tied alias: the receiver updates it through the first name
            continue
        storages.add(storage)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor.detach().clone()
        size += nbytes
    if bucket:
        yield bucket
