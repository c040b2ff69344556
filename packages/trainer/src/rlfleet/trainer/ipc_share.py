"""The sending half of the ``cuda_ipc`` weight carrier: share GPU buckets with a colocated engine.

A bucket from :func:`~rlfleet.trainer.weights.iter_weight_buckets` with ``on_device=True`` is a
set of views of one flat buffer on the trainer's GPU. :func:`share_bucket` describes that buffer as
an :class:`~rlfleet.common.schema.carriers.IpcBucket`: torch's CUDA storage sharing gives the
allocation's IPC handle, the storage's offset in it, a cross-process reference counter and the
event that orders the receiver after the copies that filled the buffer. The receiving engine maps
it (:mod:`rlfleet.rollout.engines.cuda_ipc`) and copies the weights out on the device.

The trainer must keep the buffers alive until every receiver has loaded them: it holds the latest
publish's buffers until the next publish (one copy of the weights in the publish dtype on its
GPU; 1 GB for a 0.5B model in bf16). Freed earlier, torch's reference counter still keeps the
memory from reuse while a receiver has it mapped.
"""

from __future__ import annotations

import base64

import torch
from torch import Tensor

from rlfleet.common.schema.carriers import IPC_DTYPES, IpcBucket, IpcTensor

_DTYPE_NAMES = {getattr(torch, name): name for name in IPC_DTYPES}


def gpu_uuid(device: torch.device) -> str:
    """The UUID of ``device`` as torch prints it; the receiver compares it with its own GPU's."""
    return str(torch.cuda.get_device_properties(device.index or 0).uuid)


def share_bucket(bucket: dict[str, Tensor]) -> IpcBucket:
    """Describe a bucket whose tensors are views of one CUDA buffer (see the module docstring).

    Raises ``ValueError`` for an empty bucket, tensors on the CPU or in several buffers, or a
    dtype CUDA IPC loads do not take.
    """
    if not bucket:
        raise ValueError("cannot share an empty bucket")
    first = next(iter(bucket.values()))
    if not first.is_cuda:
        raise ValueError("CUDA IPC shares GPU buffers; this bucket is on the CPU")
    storage = first.untyped_storage()
    tensors = []
    for name, tensor in bucket.items():
        if tensor.untyped_storage().data_ptr() != storage.data_ptr():
            raise ValueError(f"tensor {name!r} is not in the bucket's buffer")
        if tensor.dtype not in _DTYPE_NAMES or not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r} ({tensor.dtype}) cannot travel by CUDA IPC")
        offset = tensor.storage_offset() * tensor.element_size()
        tensors.append(IpcTensor(name=name, dtype=_DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape),
                                 offset=offset))  # fmt: skip
    (_device, handle, size, offset, ref_counter, ref_offset, event, event_sync) = storage._share_cuda_()
    return IpcBucket(
        gpu_uuid=gpu_uuid(first.device),
        handle=base64.b64encode(handle).decode(),
        storage_bytes=int(size),
        storage_offset=int(offset),
        ref_counter=ref_counter.decode() if ref_counter else "",
        ref_counter_offset=int(ref_offset),
        event_handle=base64.b64encode(event).decode() if event else "",
        event_sync_required=bool(event_sync),
        tensors=tensors,
    )
