"""Walking a model's weights in size-bounded buckets, for publishing them to rollout workers.

Tied weights: when ``lm_head.weight`` shares its storage with ``model.embed_tokens.weight`` the
state dict lists both names for one tensor. By default each storage is yielded once, under the
first name in state-dict order (``model.embed_tokens.weight``: the name ``save_pretrained`` keeps
and the one vLLM loads for tied models, where it skips ``lm_head.weight``). An HF receiver that
loads the bucket with ``load_state_dict(strict=False)`` updates the shared tensor through that
name. :func:`tied_aliases` lists the dropped names; ``include_tied=True`` yields them too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: kept_name}`` for every state-dict entry that shares storage with an earlier one."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
    return aliases


def iter_weight_buckets(
    model: nn.Module,
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    include_tied: bool = False,
    only: set[str] | None = None,
) -> Iterator[dict[str, Tensor]]:
    """Yield the state dict in buckets of at most ``bucket_bytes`` (HF names, state-dict order).

    Each tensor is a detached, contiguous CPU copy (in ``dtype`` when given), so a bucket stays
    valid across later optimizer steps; peak extra memory is one bucket. A tensor larger than
    ``bucket_bytes`` travels alone in its own bucket.

    Args:
        model: the model whose ``state_dict()`` to walk.
        bucket_bytes: size bound of one bucket, counted in the yielded dtype (> 0).
        dtype: convert floating tensors to it (e.g. bfloat16 for the engine); None keeps them.
        include_tied: also yield tied aliases (see the module docstring).
        only: yield just these names (e.g. the trainable ones when lower layers are frozen: the
            receiver already holds the frozen ones from the same checkpoint); None yields all.

    Yields:
        ``{name: tensor}`` dicts, never empty.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0; got {bucket_bytes}")
    skip = set() if include_tied else set(tied_aliases(model))
    bucket: dict[str, Tensor] = {}
    size = 0
    for name, tensor in model.state_dict().items():
        if name in skip or (only is not None and name not in only):
            continue
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * torch.empty((), dtype=target).element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor.detach().to(device="cpu", dtype=target, copy=True).contiguous()
        size += nbytes
    if bucket:
        yield bucket
