"""Full tensors from FSDP2 shards, many parameters per collective.

``DTensor.full_tensor()`` costs one all-gather (and its Python dispatch) per parameter: for a
model of a few hundred parameters that is latency, not bandwidth (about 10 GB/s for a 0.5B model
on two H200s). :func:`iter_full` packs the local shards of consecutive parameters that share a
mesh, a mesh dimension and a dtype into one buffer, all-gathers it once, and cuts the full
tensors back out; anything else (another placement, a plain tensor) takes the per-parameter path.

Layout: FSDP2 (like ``Shard(0)``) splits dim 0 as ``torch.chunk`` does: rank r holds rows
``[r * c, min(d0, (r + 1) * c))`` with ``c = ceil(d0 / W)``. Each rank writes its rows into a slot
of ``c * row_numel`` elements (the tail of a short slot is never read), so the gathered buffer
``(W, sum of slots)`` holds parameter i's full rows as ``buffer[:, slot_i]`` in rank order.

Memory on a rank: the send buffer (1/W of the group), the gathered buffer (the group), and one
full parameter being cut out at a time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

logger = logging.getLogger(__name__)

# the same collective; torch >= 2.13 renamed it (and warns on the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_dim(tensor: Tensor) -> int | None:
    """The mesh dimension a DTensor is split over along dim 0, when that is its only split."""
    if not isinstance(tensor, DTensor) or tensor.ndim == 0:
        return None
    placements = tensor.placements
    shards = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    plain = all(isinstance(p, (Shard, Replicate)) for p in placements)
    if not plain or len(shards) != 1 or placements[shards[0]].dim != 0:
        return None
    return shards[0]


def _key(tensor: Tensor, dtype: torch.dtype) -> tuple[object, ...] | None:
    dim = shard_dim(tensor)
    if dim is None:
        return None
    assert isinstance(tensor, DTensor)
    return (id(tensor.device_mesh), dim, dtype)


def _single(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """The whole tensor in ``dtype``; a DTensor is converted on its shard first, then gathered."""
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        return tensor.to(dtype).full_tensor()
    return tensor.to(dtype)


def _packed(tensors: Sequence[Tensor], dtype: torch.dtype, keep: bool) -> Iterator[Tensor]:
    """Gather DTensors sharded alike in one all-gather; yield their full tensors (when ``keep``)."""
    first = tensors[0]
    assert isinstance(first, DTensor)
    dim = shard_dim(first)
    assert dim is not None
    group = first.device_mesh.get_group(dim)
    world = dist.get_world_size(group)
    rows = [-(-t.shape[0] // world) for t in tensors]
    slots = [r * math.prod(t.shape[1:]) for r, t in zip(rows, tensors, strict=True)]
    local_device = first.to_local().device
    send = torch.empty(sum(slots), dtype=dtype, device=local_device)
    offset = 0
    for tensor, slot in zip(tensors, slots, strict=True):
        local = tensor.to_local().detach().reshape(-1)  # detach the plain shard: cheaper than the DTensor
        send[offset : offset + local.numel()].copy_(local)
        offset += slot
    gathered = torch.empty(world * sum(slots), dtype=dtype, device=local_device)
    _all_gather(gathered, send, group=group)
    del send
    gathered = gathered.view(world, -1)
    if not keep:
        return
    offset = 0
    for tensor, row, slot in zip(tensors, rows, slots, strict=True):
        part = gathered[:, offset : offset + slot].reshape(world * row, *tensor.shape[1:])
        offset += slot
        yield part[: tensor.shape[0]]


def iter_full(
    tensors: Sequence[Tensor], dtypes: Sequence[torch.dtype], keep: bool = True
) -> Iterator[Tensor]:
    """Full tensors of ``tensors`` (plain or DTensor), each in its dtype of ``dtypes``, in order.

    Every rank must call it with the same tensors (the gathers are collectives). With
    ``keep=False`` the gathers run but nothing is yielded (a rank that keeps no weights).
    """
    i = 0
    while i < len(tensors):
        key = _key(tensors[i], dtypes[i])
        j = i + 1
        while key is not None and j < len(tensors) and _key(tensors[j], dtypes[j]) == key:
            j += 1
        if key is None:
            full = _single(tensors[i], dtypes[i])
            if keep:
                yield full
        else:
            yield from _packed(tensors[i:j], dtypes[i], keep)
        i = j
