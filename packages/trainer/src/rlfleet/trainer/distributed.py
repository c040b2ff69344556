"""Trainer ranks: NCCL, the process group and device mesh, FSDP2 sharding, saving a sharded model.

A trainer of W ranks runs one process per rank (per GPU), started by ``torchrun``, by the
embedded launcher, or by any orchestrator that sets the torchrun variables::

    RANK, WORLD_SIZE          this process's rank and the number of ranks
    LOCAL_RANK                its index on this node (the CUDA device it takes, among those it sees)
    LOCAL_WORLD_SIZE          ranks per node (optional: default WORLD_SIZE, i.e. one node)
    MASTER_ADDR, MASTER_PORT  where rank 0 listens for the rendezvous

Sharding (``sharding`` of the trainer's ModelSettings): ``full`` shards every parameter over all ranks
(FSDP/ZeRO-3); ``hybrid`` shards within a node and replicates across nodes (HSDP, a 2-D mesh
``(replicate=nodes, shard=ranks per node)``: all-gathers stay on NVLink, only the gradient
all-reduce crosses nodes); ``none`` replicates the whole model on every rank (a
``(replicate=W, shard=1)`` mesh: DDP-like); ``auto`` is ``full`` on one node, ``hybrid`` on more.
With W = 1 there is no process group and no FSDP at all.

FSDP2: each decoder block is its own FSDP unit (one all-gather before its forward, one
reduce-scatter after its backward), and the root takes what is left (embeddings, final norm,
lm_head; a tied lm_head is one parameter with the embedding). On GPU the policy is bf16
parameters for compute with float32 gradient reduction and float32 master weights and optimizer
state; on CPU everything stays float32 (CPU matmuls in bf16 gain little under gloo and lose
exactness).

All of it runs when the ranks start and when a model is loaded (the reference: in the first step
that needs it) or saved, not in the steps: which rows each rank runs in a step, and the sums over
ranks a step needs, are the policy forward's (:mod:`rlfleet.trainer.policy`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rlfleet.common.schema.trainer import Sharding
from rlfleet.trainer.model_io import decoder_layers, save_hf
from rlfleet.trainer.weights import iter_weight_buckets

logger = logging.getLogger(__name__)


TIMEOUT_ENV = "RLFLEET_DIST_TIMEOUT_MINUTES"
"""Where :func:`setup_nccl` leaves the collective timeout for :func:`init_distributed` to read."""

DEFAULT_TIMEOUT_MINUTES = 20.0
"""The collective timeout when none is set: a rank stuck (alive) in a collective fails within it; a
rank that died is reported much sooner (``rank_silence_s``, :mod:`rlfleet.trainer.rank_liveness`)."""


def setup_nccl(
    timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES, enable_p2p: bool = True, *, enable_nvls: bool = False
) -> timedelta:
    """Set the NCCL environment and the process-group timeout, consistently; call before init.

    Sets (overwriting earlier values, so that every rank agrees):

    - ``NCCL_P2P_DISABLE``: ``0`` lets NCCL move data GPU to GPU directly (NVLink, PCIe P2P);
      ``1`` (``enable_p2p=False``) routes through host memory, for hosts where P2P is broken
      (some virtualized or consumer machines hang or corrupt data with it).
    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: when a collective fails or passes the timeout, the
      watchdog aborts the communicator and the process raises, instead of hanging forever.
    - ``TORCH_NCCL_BLOCKING_WAIT=0``: waits stay asynchronous (the watchdog above enforces the
      timeout); ``1`` would make every wait block the Python thread, which costs overlap.
    - ``NCCL_NVLS_ENABLE=0`` (unless ``enable_nvls``): no NVLink SHARP multicast. On shared hosts
      a program using it can put the host's GPUs out of service; the gain is small for FSDP.
    - ``TORCH_NCCL_TIMEOUT`` is no NCCL variable; the timeout is the process group's. It goes to
      ``RLFLEET_DIST_TIMEOUT_MINUTES``, which :func:`init_distributed` reads, so a collective that
      waits longer than ``timeout_minutes`` (a dead or stuck rank) fails on every rank.

    Returns:
        the collective timeout as a ``timedelta`` (also usable for ``init_process_group``).
    """
    if timeout_minutes <= 0:
        raise ValueError(f"timeout_minutes must be > 0; got {timeout_minutes}")
    os.environ["NCCL_P2P_DISABLE"] = "0" if enable_p2p else "1"
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "0"
    os.environ["NCCL_NVLS_ENABLE"] = "1" if enable_nvls else "0"
    if not enable_nvls:
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ[TIMEOUT_ENV] = str(float(timeout_minutes))
    logger.info("NCCL: p2p %s, NVLS %s, timeout %g min", enable_p2p, enable_nvls, timeout_minutes)
    return timedelta(minutes=timeout_minutes)


@dataclass(frozen=True)
class DistContext:
    """Where this process stands among the trainer ranks.

    Attributes:
        rank, world_size: global rank and number of ranks.
        local_rank, local_world_size: index on this node and ranks per node.
        device: this rank's device (``cuda:LOCAL_RANK`` or ``cpu``).
        mesh: the FSDP mesh (1-D ``("shard",)`` or 2-D ``("replicate", "shard")``); None when
            ``world_size == 1``.
        sharding: the resolved strategy (``full``, ``hybrid`` or ``none``).
        distributed: True with more than one rank (then the models are under FSDP); set from
            ``world_size`` (the ranks do not change while they run).
        is_main: rank 0, the one that talks to NATS and stages published weights; set from ``rank``.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    mesh: DeviceMesh | None = None
    sharding: Literal["full", "hybrid", "none"] = "none"
    distributed: bool = field(init=False)
    is_main: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "distributed", self.world_size > 1)
        object.__setattr__(self, "is_main", self.rank == 0)


def resolve_sharding(sharding: Sharding, num_nodes: int) -> Literal["full", "hybrid", "none"]:
    """``auto`` -> ``full`` on one node, ``hybrid`` on several; the others stay as they are."""
    if sharding == "auto":
        return "full" if num_nodes == 1 else "hybrid"
    return sharding


def build_mesh(
    device_type: str, sharding: Sharding, world_size: int, local_world_size: int
) -> tuple[DeviceMesh, Literal["full", "hybrid", "none"]]:
    """The FSDP device mesh for ``sharding`` (see the module docstring); needs an initialized group."""
    if world_size % local_world_size:
        raise ValueError(
            f"WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world_size}; "
            "start the same number of ranks on every node"
        )
    resolved = resolve_sharding(sharding, world_size // local_world_size)
    if resolved == "full":
        mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    elif resolved == "hybrid":
        shape = (world_size // local_world_size, local_world_size)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device_type, (world_size, 1), mesh_dim_names=("replicate", "shard"))
    return mesh, resolved


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set; start the ranks with torchrun")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def rank_cuda_index(local_rank: int) -> int:
    """The CUDA device a rank takes: ``LOCAL_RANK`` among the GPUs it sees, modulo their number, so
    a rank that sees only its own GPU (the embedded launcher's ``CUDA_VISIBLE_DEVICES`` per rank)
    takes ``cuda:0`` and one that sees the node's GPUs (``torchrun``) takes ``cuda:LOCAL_RANK``."""
    return local_rank % max(1, torch.cuda.device_count())


def init_distributed(device: str = "auto", sharding: Sharding = "auto") -> DistContext:
    """Join the trainer's process group from the torchrun environment and build the mesh.

    Without ``WORLD_SIZE`` (or with 1) this is a single process: no group, no mesh. Otherwise
    the backend is NCCL on GPU and gloo on CPU, the timeout is the one :func:`setup_nccl` set
    (20 minutes by default; ``setup_nccl`` is called with defaults when it was not called).

    Args:
        device: ``cpu``, ``cuda`` or ``auto`` (CUDA when available).
        sharding: see the module docstring.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if world_size == 1:
        return DistContext(device=torch.device("cuda" if use_cuda else "cpu"))
    rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(f"environment variable {name} is not set; start the ranks with torchrun")
    if TIMEOUT_ENV not in os.environ:
        setup_nccl()
    timeout = timedelta(minutes=float(os.environ[TIMEOUT_ENV]))
    if use_cuda:
        where = torch.device("cuda", rank_cuda_index(local_rank))
        torch.cuda.set_device(where)
    else:
        where = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        kwargs = {"device_id": where} if use_cuda else {}
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    mesh, resolved = build_mesh(where.type, sharding, world_size, local_world_size)
    logger.info("rank %d/%d (local %d) on %s, sharding %s, mesh %s", rank, world_size, local_rank, where,
                resolved, tuple(mesh.shape))  # fmt: skip
    return DistContext(rank, world_size, local_rank, local_world_size, where, mesh, resolved)


def shared_seed(seed: int | None, ctx: DistContext) -> int:
    """``seed``, or (None) a random seed drawn on rank 0 and broadcast, so every rank agrees."""
    if seed is not None:
        return seed
    drawn = torch.randint(0, 2**62, (1,), device=ctx.device)
    if ctx.distributed:
        dist.broadcast(drawn, src=0)
    return int(drawn.item())


# --- FSDP2: sharding a model, saving it -----------------------------------------------------------


def mixed_precision_policy(device: torch.device, bf16: bool) -> MixedPrecisionPolicy:
    """bf16 compute with float32 gradient reduction on GPU when ``bf16``; float32 otherwise."""
    if bf16 and device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(
    model: nn.Module, ctx: DistContext, *, bf16: bool, reshard_after_forward: bool = True
) -> None:
    """Apply ``fully_shard`` to every decoder block, then to the root (nothing with one rank).

    Parameters become DTensor shards on the rank's device (moved there from the CPU copy that
    every rank loaded). ``reshard_after_forward`` frees each block's gathered weights after its
    forward (ZeRO-3); False keeps them until backward (more memory, fewer all-gathers).
    ``bf16`` selects :func:`mixed_precision_policy`'s bf16 compute (on GPU only).
    """
    if ctx.mesh is None:
        return
    policy = mixed_precision_policy(ctx.device, bf16)
    for block in decoder_layers(model):
        fully_shard(block, mesh=ctx.mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=ctx.mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def save_hf_sharded(
    model: nn.Module,
    path: str | Path,
    is_main: bool,
    *,
    source_dir: str | Path | None = None,
    bucket_bytes: int = 1 << 28,
) -> Path:
    """Save an FSDP model in HF format; every rank calls it, rank 0 (``is_main``) writes.

    The weights are gathered a bucket at a time into rank 0's host memory, which holds the
    whole state dict while it writes; the other ranks keep nothing.
    """
    state = gathered_state(model, is_main, bucket_bytes=bucket_bytes)
    if is_main:
        save_hf(model, path, source_dir=source_dir, state_dict=state)  # type: ignore[arg-type]
    torch.distributed.barrier()
    return Path(path)


def gathered_state(
    model: nn.Module, is_main: bool, *, state: Mapping[str, Tensor] | None = None, bucket_bytes: int = 1 << 28
) -> dict[str, Tensor]:
    """``model``'s state dict (or ``state``: tensors of it, or computed from it, such as a LoRA
    actor's merged weights) as full tensors on the host of rank 0 (``is_main``), tied aliases
    included; ``{}`` on the other ranks. Under FSDP every rank calls it (the gathers are collectives)."""
    out: dict[str, Tensor] = {}
    for bucket in iter_weight_buckets(model, bucket_bytes, include_tied=True, keep=is_main, state=state):
        out.update(bucket)
    return out
