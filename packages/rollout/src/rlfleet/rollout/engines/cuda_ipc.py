"""The receiving half of the ``cuda_ipc`` weight carrier: map a trainer's GPU buckets in place.

A colocated trainer keeps each published bucket as one flat buffer on its GPU and sends an
:class:`~rlfleet.common.schema.carriers.IpcBucket` describing it (the CUDA IPC handle, the storage's
size and offset, the tensors' names, dtypes, shapes and byte offsets). :func:`open_bucket` maps
the buffer into this process and returns views of it, which an engine copies into its weights.

Nothing here unpickles: the bucket is a validated pydantic model, the storage and tensor classes
are fixed, the dtype comes from a whitelist, and every tensor is checked to lie inside the
buffer before a view is made. A bucket that lives on another GPU is refused by name
(:class:`~rlfleet.rollout.errors.IpcUnavailable`) before any handle is opened.

Lifetime: the views keep the mapping (and torch's cross-process reference count) alive; drop
them once the copy into the engine has completed on the device (:func:`load_and_release`
synchronizes), and the trainer may then free or reuse its buffer.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence

import torch

from rlfleet.common.schema.carriers import IpcBucket
from rlfleet.rollout.errors import IpcUnavailable

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

Items = list[tuple[str, torch.Tensor]]


def device_uuid(device: torch.device | int) -> str:
    """The UUID of a CUDA device as torch prints it (what trainers put in ``IpcBucket.gpu_uuid``)."""
    index = device if isinstance(device, int) else (device.index or 0)
    return str(torch.cuda.get_device_properties(index).uuid)


def _b64(value: str, field: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise IpcUnavailable(f"{field} is not valid base64: {exc}") from None


def open_bucket(bucket: IpcBucket, device: torch.device | int) -> Items:
    """Map ``bucket`` on ``device`` (which must be the bucket's GPU); ``(name, view)`` pairs in order."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise IpcUnavailable("CUDA IPC buckets need a CUDA device; this process has none")
    index = device if isinstance(device, int) else (device.index or 0)
    here = device_uuid(index)
    if here != bucket.gpu_uuid:
        raise IpcUnavailable(f"the bucket lives on GPU {bucket.gpu_uuid}, this engine is on GPU {here}")
    handle = _b64(bucket.handle, "handle")
    event = _b64(bucket.event_handle, "event_handle") if bucket.event_handle else b""
    flat = rebuild_cuda_tensor(
        torch.Tensor, (bucket.storage_bytes,), (1,), 0, torch.UntypedStorage, torch.uint8, index, handle,
        bucket.storage_bytes, bucket.storage_offset, False, bucket.ref_counter.encode(),
        bucket.ref_counter_offset, event, bucket.event_sync_required,
    )  # fmt: skip
    if flat.numel() != bucket.storage_bytes:
        raise IpcUnavailable(
            f"the mapped buffer holds {flat.numel()} bytes, the bucket says {bucket.storage_bytes}"
        )
    return [
        (t.name, flat[t.offset : t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape))
        for t in bucket.tensors
    ]


def meta_items(buckets: Sequence[IpcBucket]) -> Items:
    """``(name, meta tensor)`` pairs of every tensor in ``buckets``: what validation needs, no mapping."""
    return [
        (t.name, torch.empty(t.shape, dtype=DTYPES[t.dtype], device="meta"))
        for b in buckets
        for t in b.tensors
    ]


def load_and_release(
    buckets: Sequence[IpcBucket], device: torch.device | int, load: Callable[[Items], object]
) -> int:
    """Open every bucket, hand all views to ``load`` at once, wait for the copies; return the tensor count."""
    items: Items = []
    for bucket in buckets:
        items.extend(open_bucket(bucket, device))
    load(items)
    torch.cuda.synchronize(device)  # the copies out of the trainer's buffers are done before we let go
    count = len(items)
    items.clear()
    return count
