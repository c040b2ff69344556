"""FSDP2 for the actor: sharding an HF causal LM, and splitting batch rows over the ranks.

Each decoder block is its own FSDP unit (one all-gather before its forward, one reduce-scatter
after its backward), and the root takes what is left (embeddings, final norm, lm_head; a tied
lm_head is one parameter with the embedding). On GPU the policy is bf16 parameters for compute
with float32 gradient reduction and float32 master weights and optimizer state; on CPU
everything stays float32 (CPU matmuls in bf16 gain little under gloo and lose exactness).

Rows: the whole batch is on every rank; rank r takes rows ``order[r::W]`` where ``order`` sorts
the rows by length (longest first, ties by index), so ranks get similar token counts and a
micro-batch holds rows of similar length. All ranks must run the same number of forwards (each
one all-gathers), so a rank with fewer rows pads with copies of a real row of weight 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rlfleet.trainer.distributed import DistContext
from rlfleet.trainer.model_io import decoder_layers, save_hf
from rlfleet.trainer.weights import iter_weight_buckets

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class LocalRows:
    """One rank's share of a set of batch rows.

    Attributes:
        rows: (K,) int64 row indices into the batch, padded to the same K on every rank.
        weights: (K,) float32, 1 for the rank's own rows, 0 for padding copies.
    """

    rows: Tensor
    weights: Tensor

    @property
    def real(self) -> Tensor:
        """(K,) bool: the rows that are this rank's own (not padding)."""
        return self.weights > 0


def local_rows(rows: Tensor, lengths: Tensor, rank: int, world_size: int) -> LocalRows:
    """Rank ``rank``'s rows of ``rows`` (M,) given every row's token count ``lengths`` (N,).

    With one rank the rows come back unchanged (same order). Otherwise the rows are sorted by
    length, longest first (stable), and dealt out ``rank::world_size``; every rank gets
    ``ceil(M / world_size)`` rows, the last ones padding (weight 0) where M does not divide.
    """
    if world_size == 1:
        return LocalRows(rows, torch.ones(len(rows), dtype=torch.float32, device=rows.device))
    if len(rows) == 0:
        raise ValueError("cannot split an empty set of rows over ranks")
    order = torch.sort(lengths[rows].cpu(), descending=True, stable=True).indices
    mine = rows[order.to(rows.device)][rank::world_size]
    target = -(-len(rows) // world_size)
    weights = torch.ones(target, dtype=torch.float32, device=rows.device)
    if len(mine) < target:
        weights[len(mine) :] = 0.0
        filler = rows[:1].expand(target - len(mine))
        mine = torch.cat([mine, filler])
    return LocalRows(mine, weights)


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
    state: dict[str, Tensor] = {}
    for bucket in iter_weight_buckets(model, bucket_bytes, include_tied=True, keep=is_main):
        state.update(bucket)
    if is_main:
        save_hf(model, path, source_dir=source_dir, state_dict=state)  # type: ignore[arg-type]
    torch.distributed.barrier()
    return Path(path)
