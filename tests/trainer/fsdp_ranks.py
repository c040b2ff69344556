"""One trainer rank of the 2-rank gloo tests (run as a script, with the torchrun variables set).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python fsdp_ranks.py MODEL BATCH OUT

Loads the actor under FSDP2 on the CPU, then, on the batch in BATCH (a safetensors file holding a
contract batch plus ``advantages``, ``old_noise`` and ``ref_shift``):

1. ``accumulate`` (the update loop's forward/backward) over all rows for each loss aggregation;
   the gathered gradients and the metrics go to ``OUT/grads_<agg>.safetensors`` and
   ``OUT/metrics.json``; the token-mean one again with gradient checkpointing, to
   ``OUT/grads_checkpointed.safetensors``;
2. publishes the weights in small buckets while a dispatch mode tracks the bytes of the tensors
   alive that the walk created (the peak goes to ``OUT/rank<r>.json``); a second walk's merged
   buckets go to ``OUT/buckets.safetensors``;
3. one policy update with shuffled mini-batches and two epochs, then the gathered parameters go to
   ``OUT/params_after.safetensors``, and the model is saved in HF format to ``OUT/hf``.

Rank 0 writes the files; every rank writes ``OUT/rank<r>.json`` (what it saw).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from rlfleet.common.schema.trainer import ModelSettings, StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.grpo import PolicyObjective, prepare
from rlfleet.trainer.distributed import init_distributed
from rlfleet.trainer.loop import accumulate

sys.path.insert(0, str(Path(__file__).parent))
from batches import update  # noqa: E402  (this folder's helper module)

AGGS = ("token-mean", "seq-mean-token-mean")
BUCKET_BYTES = 9216


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that ops run under it created and that are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.owners: dict[int, int] = {}  # storage pointer -> tensors alive on it
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.owners[key] -= 1
        if self.owners[key] == 0:
            del self.owners[key]
            self.live -= self.sizes.pop(key)

    def _track(self, tensor: torch.Tensor, aliases: bool) -> None:
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if isinstance(local, AsyncCollectiveTensor):  # a wrapper: the bytes are its ``elem``'s
            local = local.elem
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or (aliases and key not in self.owners):
            return  # a view or in-place result on memory that existed before: nothing new
        if key not in self.owners:
            self.owners[key] = 0
            self.sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.owners[key] += 1  # a view of new memory keeps it alive too
        weakref.finalize(tensor, self._release, key)

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        aliases = any(ret.alias_info is not None for ret in func._schema.returns)
        for item in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(item, torch.Tensor):
                self._track(item, aliases)
        return out


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main(model_dir: str, batch_path: str, out_dir: str) -> None:
    out = Path(out_dir)
    ctx = init_distributed(device="cpu", sharding="full")
    data = load_file(batch_path)
    adv, old_noise, ref_shift = data.pop("advantages"), data.pop("old_noise"), data.pop("ref_shift")
    actor = Actor(model_dir, None, ctx, learning_rate=1e-2, weight_decay=0.0)
    seen: dict[str, Any] = {"rank": ctx.rank, "world_size": ctx.world_size, "mesh": list(ctx.mesh.shape)}
    seen["dtensor_params"] = all(isinstance(p, DTensor) for p in actor.model.parameters())
    seen["share_prompts"] = actor.share_prompts  # off: the ranks must run the same forwards

    prepared = prepare(actor, data, adv, micro_batch_size=2, with_reference=True)
    prepared = dataclasses.replace(
        prepared,
        old_logprobs=prepared.old_logprobs + old_noise,
        ref_logprobs=prepared.ref_logprobs + ref_shift,
    )
    metrics: dict[str, dict[str, float]] = {}
    rows = torch.arange(prepared.inputs.num_samples)
    for agg in AGGS:
        settings = StepSettings(update=UpdateSettings(kl_coef=0.1, entropy_coef=0.01, loss_agg=agg))
        loss = PolicyObjective(actor, prepared, settings)
        metrics[agg] = accumulate(loss, rows, 2)
        grads = {
            n: full(p.grad).contiguous() for n, p in actor.model.named_parameters() if p.grad is not None
        }
        actor.optimizer.zero_grad(set_to_none=True)
        if ctx.is_main:
            save_file(grads, str(out / f"grads_{agg}.safetensors"))
    # gradient checkpointing under FSDP: the blocks recompute (and re-gather) in backward
    checkpointed = Actor(model_dir, ModelSettings(gradient_checkpointing=True), ctx, learning_rate=1e-2)
    settings = StepSettings(update=UpdateSettings(kl_coef=0.1, entropy_coef=0.01, loss_agg=AGGS[0]))
    accumulate(PolicyObjective(checkpointed, prepared, settings), rows, 2)
    grads = {
        n: full(p.grad).contiguous() for n, p in checkpointed.model.named_parameters() if p.grad is not None
    }
    if ctx.is_main:
        save_file(grads, str(out / "grads_checkpointed.safetensors"))
    del checkpointed

    tracker = LiveBytes()
    sizes = []
    with tracker:  # stream the buckets away one by one, as a publish does
        for bucket in actor.iter_weight_buckets(BUCKET_BYTES):
            sizes.append(sum(t.numel() * t.element_size() for t in bucket.values()))
            del bucket
    seen["bucket_bytes"] = sizes
    seen["peak_bytes"] = tracker.peak
    seen["largest_param_bytes"] = max(p.numel() * p.element_size() for p in actor.model.parameters())
    seen["model_bytes"] = sum(p.numel() * p.element_size() for p in actor.model.parameters())
    merged = {
        name: t.clone() for bucket in actor.iter_weight_buckets(BUCKET_BYTES) for name, t in bucket.items()
    }
    if ctx.is_main:
        save_file(merged, str(out / "buckets.safetensors"))
        (out / "metrics.json").write_text(json.dumps(metrics))

    # 5 rows in 2 updates: mini-batches of 3 and 2
    metrics["update"] = update(
        actor, data, adv, micro_batch_size=2, num_updates=2, ppo_epochs=2, max_grad_norm=0.5
    )
    params = {n: full(p.detach()).contiguous() for n, p in actor.model.named_parameters()}
    actor.save_hf(out / "hf")
    if ctx.is_main:
        save_file(params, str(out / "params_after.safetensors"))
        (out / "metrics.json").write_text(json.dumps(metrics))
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
