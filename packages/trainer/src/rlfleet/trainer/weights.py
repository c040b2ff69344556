"""Walking a model's weights in size-bounded buckets, for publishing them to rollout workers.

Works for a plain model and for one sharded by FSDP2 (parameters are DTensor shards). For a
sharded model every rank walks the same buckets in the same order: the bucket's shards are
converted to the target dtype (so the gather moves bf16, not float32) and all-gathered, one
collective for all parameters sharded alike (:func:`iter_full`), and each full tensor is copied
into the bucket's host buffer on the rank that keeps buckets (rank 0); the others drop them. The
extra memory on a rank is thus about one bucket on the device (the gathered shards, plus one full
parameter being cut out) and one bucket on the host; with pinned buckets on the GPU, where the
device-to-host copy of one bucket overlaps the gather of the next, two of each.

Gathering: ``DTensor.full_tensor()`` costs one all-gather (and its Python dispatch) per
parameter: for a model of a few hundred parameters that is latency, not bandwidth (about 10 GB/s
for a 0.5B model on two H200s). :func:`iter_full` packs the local shards of consecutive
parameters that share a mesh, a mesh dimension and a dtype into one buffer, all-gathers it once,
and cuts the full tensors back out; anything else (another placement, a plain tensor) takes the
per-parameter path. FSDP2 (like ``Shard(0)``) splits dim 0 as ``torch.chunk`` does: rank r holds
rows ``[r * c, min(d0, (r + 1) * c))`` with ``c = ceil(d0 / W)``. Each rank writes its rows into
a slot of ``c * row_numel`` elements (the tail of a short slot is never read), so the gathered
buffer ``(W, sum of slots)`` holds parameter i's full rows as ``buffer[:, slot_i]`` in rank order.

Tied weights: when ``lm_head.weight`` shares its storage with ``model.embed_tokens.weight`` the
state dict lists both names for one tensor. By default each storage is yielded once, under the
first name in state-dict order (``model.embed_tokens.weight``: the name ``save_pretrained`` keeps
and the one vLLM loads for tied models, where it skips ``lm_head.weight``). An HF receiver that
loads the bucket with ``load_state_dict(strict=False)`` updates the shared tensor through that
name. :func:`tied_aliases` lists the dropped names; ``include_tied=True`` yields them too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

if TYPE_CHECKING:
    from rlfleet.common.schema.refs import TensorRef
    from rlfleet.common.tensors.server import TensorStoreServer

logger = logging.getLogger(__name__)


# --- gathering FSDP2 shards, many parameters per collective ---------------------------------------

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


# --- buckets --------------------------------------------------------------------------------------

_ALIGN = 64
"""Byte alignment of each tensor inside a bucket's host buffer."""


def _storage_key(tensor: Tensor) -> tuple[int, ...]:
    if isinstance(tensor, DTensor):  # a wrapper: tied parameters are the same Python object
        return (id(tensor),)
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), *tensor.shape)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: kept_name}`` for every state-dict entry that shares storage with an earlier one."""
    return _aliases(model.state_dict(keep_vars=True))


def _aliases(state: Mapping[str, Tensor]) -> dict[str, str]:
    seen: dict[tuple[int, ...], str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        key = _storage_key(tensor)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
    return aliases


@dataclass(frozen=True)
class _Slot:
    name: str
    tensor: Tensor  # as in the state dict: plain or a DTensor shard
    dtype: torch.dtype  # the dtype it is published in
    offset: int  # byte offset in the bucket's host buffer

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.dtype.itemsize


def _plan(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None, include_tied: bool, only: set[str] | None,
    state: Mapping[str, Tensor] | None = None,
) -> Iterator[list[_Slot]]:  # fmt: skip
    """Group the state dict (or ``state``) into buckets of at most ``bucket_bytes`` (a larger tensor
    goes alone)."""
    if state is None:
        state = model.state_dict(keep_vars=True)  # one walk (slow for a big FSDP model); detached later
    skip = set() if include_tied else set(_aliases(state))
    bucket: list[_Slot] = []
    size = end = 0  # payload bytes, and the end of the last tensor in the host buffer
    for name, tensor in state.items():
        if name in skip or (only is not None and name not in only):
            continue
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * target.itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size, end = [], 0, 0
        offset = -(-end // _ALIGN) * _ALIGN
        bucket.append(_Slot(name, tensor, target, offset))
        size += nbytes
        end = offset + nbytes
    if bucket:
        yield bucket


@dataclass
class _InFlight:
    """A bucket whose device-to-host copies run on the side stream until ``done``."""

    bucket: dict[str, Tensor]
    done: torch.cuda.Event | None

    def wait(self) -> dict[str, Tensor]:
        if self.done is not None:
            self.done.synchronize()
        return self.bucket


def _launch_bucket(slots: list[_Slot], keep: bool, copy_stream: torch.cuda.Stream) -> _InFlight:
    """Gather the bucket on the current stream, then copy it into pinned host memory on
    ``copy_stream``: the copies overlap the next bucket's gather (see :func:`iter_weight_buckets`)."""
    fulls = list(iter_full([s.tensor for s in slots], [s.dtype for s in slots], keep=keep))
    if not keep:
        return _InFlight({}, None)
    end = slots[-1].offset + slots[-1].nbytes
    buffer = torch.empty(end, dtype=torch.uint8, pin_memory=True)
    copy_stream.wait_stream(torch.cuda.current_stream())  # the gathers of this bucket come first
    bucket: dict[str, Tensor] = {}
    with torch.cuda.stream(copy_stream):
        for slot, full in zip(slots, fulls, strict=True):
            view = buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(full.shape)
            view.copy_(full, non_blocking=True)
            if full.is_cuda:
                full.record_stream(copy_stream)  # its memory is not reused before the copy is done
            bucket[slot.name] = view
    done = torch.cuda.Event()
    done.record(copy_stream)
    return _InFlight(bucket, done)


def _pipelined(plan: Iterator[list[_Slot]], keep: bool) -> Iterator[dict[str, Tensor]]:
    """Buckets with bucket i's device-to-host copy overlapping bucket i+1's gather (two in flight)."""
    copy_stream = torch.cuda.Stream()
    pending: _InFlight | None = None
    for slots in plan:
        current = _launch_bucket(slots, keep, copy_stream)
        if pending is not None:
            yield pending.wait()
        pending = current
    if pending is not None:
        yield pending.wait()


def _gather_bucket(
    slots: list[_Slot], keep: bool, pin_memory: bool, device: torch.device | None = None
) -> dict[str, Tensor]:
    """Gather the bucket's tensors and (when ``keep``) copy them into one fresh buffer: on the
    host, or on ``device`` when given (the copies then stay on the GPU, in stream order)."""
    end = slots[-1].offset + slots[-1].nbytes
    pin_memory = pin_memory and torch.cuda.is_available() and device is None
    if not keep:
        buffer = None
    elif device is not None:
        buffer = torch.empty(end, dtype=torch.uint8, device=device)
    else:
        buffer = torch.empty(end, dtype=torch.uint8, pin_memory=pin_memory)
    bucket: dict[str, Tensor] = {}
    on_device = False
    fulls = iter_full([s.tensor for s in slots], [s.dtype for s in slots], keep=keep)
    for slot, full in zip(slots, fulls, strict=False):  # every rank: the gathers are collectives
        assert buffer is not None
        view = buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(full.shape)
        view.copy_(full, non_blocking=pin_memory)
        on_device = on_device or full.device.type != "cpu"
        bucket[slot.name] = view
    if on_device and pin_memory:
        torch.cuda.current_stream().synchronize()  # the async device-to-host copies are done
    return bucket


def iter_weight_buckets(
    model: nn.Module,
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    include_tied: bool = False,
    only: set[str] | None = None,
    keep: bool = True,
    pin_memory: bool = False,
    on_device: bool = False,
    state: Mapping[str, Tensor] | None = None,
) -> Iterator[dict[str, Tensor]]:
    """Yield the state dict in buckets of at most ``bucket_bytes`` (HF names, state-dict order).

    Each tensor is a detached, contiguous copy (in ``dtype`` when given; the tensors of a bucket
    are views of one buffer, on the host unless ``on_device``), so a bucket stays valid across
    later optimizer steps.
    A tensor larger than ``bucket_bytes`` travels alone in its own bucket. With an FSDP2 model
    every rank must iterate (the gathers are collectives); see the module docstring.

    Args:
        model: the model whose ``state_dict()`` to walk.
        bucket_bytes: size bound of one bucket, counted in the yielded dtype (> 0).
        dtype: convert floating tensors to it (e.g. bfloat16 for the engine); None keeps them.
        include_tied: also yield tied aliases (see the module docstring).
        only: yield just these names (e.g. the trainable ones when lower layers are frozen: the
            receiver already holds the frozen ones from the same checkpoint); None yields all.
        keep: False on ranks that take part in the gathers but keep nothing: they yield ``{}``
            for each bucket, in step with the keeping rank.
        pin_memory: put buckets in page-locked host memory (faster device-to-host copies; ignored
            without CUDA). For a model on the GPU the copies then run on a side stream, bucket i's
            overlapping bucket i+1's gather: two buckets are in flight, on the device and the host.
        on_device: keep each bucket in one flat buffer on the model's GPU instead of the host
            (the tensors are views of it at 64-byte aligned offsets): what CUDA IPC shares with a
            colocated engine. The buffers are new for every call; each stays as long as its views.
        state: walk these tensors instead of ``model``'s state dict (a LoRA actor's weights with
            the adapters merged, :func:`rlfleet.trainer.lora.merged_state`, or its adapter); under
            FSDP they are DTensor shards, gathered like the model's.

    Yields:
        ``{name: tensor}`` dicts, never empty on a keeping rank.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0; got {bucket_bytes}")
    plan = _plan(model, bucket_bytes, dtype, include_tied, only, state)
    on_gpu = any(p.is_cuda for p in model.parameters())
    if on_device:
        if not on_gpu:
            raise ValueError("on_device=True needs a model on a CUDA device")
        device = next(p.device for p in model.parameters() if p.is_cuda)
        for slots in plan:
            yield _gather_bucket(slots, keep, False, device)
        return
    if pin_memory and on_gpu and torch.cuda.is_available():
        yield from _pipelined(plan, keep)
        return
    for slots in plan:
        yield _gather_bucket(slots, keep, pin_memory)


def to_host(bucket: dict[str, Tensor]) -> dict[str, Tensor]:
    """A host copy of a bucket from ``on_device=True``: one pinned buffer, the same offsets, in one copy."""
    first = next(iter(bucket.values()), None)
    if first is None or not first.is_cuda:
        return bucket
    storage = first.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)  # the bucket's whole buffer
    host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(flat)
    out = {}
    for name, t in bucket.items():
        start = t.storage_offset() * t.element_size()
        out[name] = host[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    return out


def put_version(
    store: TensorStoreServer, version: int, buckets: Iterable[dict[str, Tensor]]
) -> list[TensorRef]:
    """A weight version's buckets into the trainer's ``store``, the ``i``-th as ``weights/v<version>/<i>``
    (a bucket on the GPU as its host copy, :func:`to_host`), taken one at a time as ``buckets`` yields
    them; their refs, in order."""
    return [store.put_local(f"weights/v{version}/{i}", to_host(bucket)) for i, bucket in enumerate(buckets)]
