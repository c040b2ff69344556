"""Weight carriers: how a published bucket reaches a rollout engine, chosen per link.

Two carriers exist today, behind one publish/load exchange (``trainer.publish`` answers with
:class:`~rlfleet.common.control.messages.WeightsPublished`, ``rollout.load_weights`` carries the same
buckets to every worker):

- ``grpc``: the trainer stages each bucket in its TensorStore and the worker streams it over the
  tensor plane (:class:`~rlfleet.common.schema.refs.TensorRef`). Works anywhere, any network, CPU or GPU.
- ``cuda_ipc``: the trainer keeps each bucket as one flat buffer on its GPU and shares a CUDA IPC
  handle of it (:class:`IpcBucket`); a worker whose engine lives on that same GPU maps the buffer
  and copies it straight into its weights: no host memory, no network. Only for a worker on the
  trainer's GPU (colocated mode) with one engine rank (``tensor_parallel_size`` 1).

The controller asks the trainer for the carriers its rollout workers need (:func:`carrier_for`
per worker); each worker takes the IPC buckets when they live on its GPU, else the gRPC ones.
This module is torch-free: it is the schema and the rule. The torch halves live in the trainer
(sharing, ``rlfleet.trainer.ipc_share``) and the rollout tier (mapping,
``rlfleet.rollout.engines.cuda_ipc``).
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

WeightCarrier = Literal["grpc", "cuda_ipc"]
CarrierSetting = Literal["auto", "grpc", "cuda_ipc"]

IPC_DTYPES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
"""dtypes a weight may travel in over CUDA IPC, with their item sizes."""

MAX_IPC_TENSORS = 65_536
"""Upper bound on the tensors of one IPC bucket (a 70B model has about 1,000)."""

_HANDLE_B64 = re.compile(r"^[A-Za-z0-9+/]{1,1400}={0,2}$")
_REF_COUNTER = re.compile(r"^/torch_[A-Za-z0-9_.-]{1,120}$")  # torch's shared-memory counter names


class IpcTensor(BaseModel):
    """One tensor inside an IPC bucket's flat buffer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=512, description="HF parameter name")
    dtype: Literal["bfloat16", "float16", "float32"]
    shape: list[int] = Field(max_length=8)
    offset: int = Field(ge=0, description="byte offset in the bucket's buffer")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * IPC_DTYPES[self.dtype]


class IpcBucket(BaseModel):
    """A bucket of weights shared from the trainer's GPU by CUDA IPC.

    The fields mirror what torch's CUDA storage sharing produces (``_share_cuda_``): the
    allocation's IPC handle (base64), the storage's size and offset in that allocation, torch's
    cross-process reference counter (a shared-memory name and slot) and the event that orders the
    consumer after the producer's writes. Everything is checked before a handle is opened.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_uuid: str = Field(min_length=1, max_length=128, description="the GPU the buffer lives on")
    handle: str = Field(description="CUDA IPC memory handle of the allocation, base64")
    storage_bytes: int = Field(gt=0, description="bytes of the shared storage (the bucket's buffer)")
    storage_offset: int = Field(ge=0, description="byte offset of the storage in the allocation")
    ref_counter: str = Field(default="", description="torch's shared-memory reference counter name")
    ref_counter_offset: int = Field(default=0, ge=0)
    event_handle: str = Field(default="", description="CUDA IPC event handle, base64; empty: none")
    event_sync_required: bool = False
    tensors: list[IpcTensor] = Field(min_length=1, max_length=MAX_IPC_TENSORS)

    @model_validator(mode="after")
    def _fits(self) -> IpcBucket:
        if not _HANDLE_B64.match(self.handle):
            raise ValueError("handle must be base64 of at most about 1 KB")
        if self.event_handle and not _HANDLE_B64.match(self.event_handle):
            raise ValueError("event_handle must be base64 of at most about 1 KB")
        if self.ref_counter and not _REF_COUNTER.match(self.ref_counter):
            raise ValueError(
                f"ref_counter {self.ref_counter[:60]!r} is not a torch shared-memory counter name"
            )
        names: set[str] = set()
        for t in self.tensors:
            if any(d < 0 for d in t.shape):
                raise ValueError(f"tensor {t.name!r} has a negative dimension in {t.shape}")
            if t.offset % IPC_DTYPES[t.dtype]:
                raise ValueError(
                    f"tensor {t.name!r} at byte {t.offset} is not aligned to its {t.dtype} items"
                )
            if t.offset + t.nbytes > self.storage_bytes:
                raise ValueError(
                    f"tensor {t.name!r} ({t.nbytes} bytes at {t.offset}) ends past the buffer's "
                    f"{self.storage_bytes} bytes"
                )
            if t.name in names:
                raise ValueError(f"tensor {t.name!r} appears twice in one bucket")
            names.add(t.name)
        return self

    @property
    def nbytes(self) -> int:
        """Payload bytes (the tensors, without alignment gaps)."""
        return sum(t.nbytes for t in self.tensors)


def carrier_for(
    setting: CarrierSetting, trainer_gpus: list[str], worker_gpus: list[str], tensor_parallel_size: int = 1
) -> WeightCarrier:
    """The carrier for one trainer -> rollout-worker link.

    ``auto``: ``cuda_ipc`` when the worker's only engine GPU is the trainer's first GPU (the one
    its rank 0 publishes from), else ``grpc``. ``grpc`` always. ``cuda_ipc`` demands it: a link
    that cannot use it raises ``ValueError`` saying why.
    """
    shared = bool(trainer_gpus) and len(worker_gpus) == 1 and worker_gpus[0] == trainer_gpus[0]
    usable = shared and tensor_parallel_size == 1
    if setting == "grpc":
        return "grpc"
    if setting == "cuda_ipc" and not usable:
        if not trainer_gpus:
            why = "the trainer announced no GPU (it runs on CPU)"
        elif not worker_gpus:
            why = "the rollout worker announced no GPU (it runs on CPU)"
        elif not shared:
            why = f"the rollout worker's GPUs {worker_gpus} are not the trainer's GPU {trainer_gpus[0]}"
        else:
            why = f"the engine spans {tensor_parallel_size} GPUs (tensor parallelism)"
        raise ValueError(f"weight_carrier 'cuda_ipc' cannot reach this rollout worker: {why}; use 'auto'")
    return "cuda_ipc" if usable else "grpc"
