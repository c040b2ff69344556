"""One rank of the 2-rank gloo LoRA tests (run as a script, with the torchrun variables set).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python lora_ranks.py MODEL OUT

Under FSDP2 on the CPU, a LoRA actor (``LORA``, seed 0):

1. computes the reference's logprobs (its first forward: the adapters off, noting whether they
   still require grad there, which FSDP2 reads then) and the policy's on the batch of
   :func:`batch`, then one backward, noting which parameters got a gradient;
2. takes :data:`STEPS` policy updates (:func:`train`), computes both logprobs again, publishes its
   weights merged and its adapter in small buckets, gathers its parameters, exports (``OUT/hf``);
3. saves a full checkpoint (``OUT/ckpt``), takes one more update; a fresh actor loads the
   checkpoint and takes the same update; both gather their adapters;
4. a fresh LoRA actor takes one DPO step (:func:`dpo_batch`).

Rank 0 writes ``OUT/tensors.safetensors`` (logprobs, buckets, parameters, grads' names) and
``OUT/seen.json``; every rank writes ``OUT/rank<r>.json`` (its bucket sizes, what it saw).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from rlfleet.common.schema.trainer import AlgorithmSettings, ModelSettings, StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.dpo import DPO
from rlfleet.trainer.algorithms.grpo import PolicyObjective, prepare
from rlfleet.trainer.checkpoint import load_checkpoint, save_checkpoint
from rlfleet.trainer.distributed import init_distributed
from rlfleet.trainer.loop import accumulate, train_loop
from rlfleet.trainer.policy import build_policy_inputs, compute_logprobs

sys.path.insert(0, str(Path(__file__).parent))
from batches import contract_batch, update  # noqa: E402  (this folder's helper module)

LORA = {"rank": 4, "alpha": 8.0}
PROMPTS, RESPONSES = [3, 5, 2, 4, 5], [4, 2, 6, 1, 3]  # 5 rows: rank 1 pads one micro-batch row
ADVANTAGES = [1.0, -1.0, 0.5, 0.0, -0.5]
STEPS = 3
BUCKET_BYTES = 4096


def lora_actor(model_dir: str, ctx: Any = None, seed: int = 0) -> Actor:
    return Actor(model_dir, ModelSettings(lora=LORA), ctx, seed=seed, learning_rate=5e-2, weight_decay=0.0)


def batch() -> dict[str, torch.Tensor]:
    return contract_batch(PROMPTS, RESPONSES, seed=3)


def train(actor: Actor, data: dict[str, torch.Tensor]) -> dict:
    """One policy update (two mini-batches, a KL term against the reference: the adapters off)."""
    return update(actor, data, torch.tensor(ADVANTAGES), micro_batch_size=2, num_updates=2, kl_coef=0.1)


def dpo_batch() -> dict[str, torch.Tensor]:
    """A pair on each prompt of :func:`batch`'s lengths: a chosen answer of tokens 3..32, a rejected
    one of tokens 33..62."""
    pairs = contract_batch(PROMPTS, [4] * len(PROMPTS), seed=5, vocab=33)
    rejected = contract_batch(PROMPTS, [4] * len(PROMPTS), seed=6, vocab=33)["response_ids"] + 30
    return {"prompt_ids": pairs["prompt_ids"], "prompt_mask": pairs["prompt_mask"],
            "chosen_ids": pairs["response_ids"], "chosen_mask": pairs["response_mask"],
            "rejected_ids": rejected, "rejected_mask": pairs["response_mask"]}  # fmt: skip


def dpo_step(actor: Actor, data: dict[str, torch.Tensor]) -> dict:
    step = StepSettings(
        algorithm=AlgorithmSettings(name="dpo", beta=0.5), update=UpdateSettings(micro_batch_size=6)
    )
    return train_loop(DPO().plan(actor, None, data, torch.zeros(0), step))


def full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).contiguous().clone()


def adapters(actor: Actor) -> dict[str, torch.Tensor]:
    """The adapters' full tensors by parameter name (every rank gathers)."""
    return {n: full(p) for n, p in actor.model.named_parameters() if ".lora_" in n}


def buckets(actor: Actor, adapter: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
    """What a publish yields here (merged weights, or ``adapter``'s tensors) and each bucket's bytes."""
    got: dict[str, torch.Tensor] = {}
    sizes = []
    for bucket in actor.iter_weight_buckets(BUCKET_BYTES, adapter=adapter):
        sizes.append(sum(t.numel() * t.element_size() for t in bucket.values()))
        got.update({name: t.clone() for name, t in bucket.items()})
    return got, sizes


def main(model_dir: str, out_dir: str) -> None:
    out = Path(out_dir)
    ctx = init_distributed(device="cpu", sharding="full")
    data = batch()
    inputs = build_policy_inputs(data)
    actor = lora_actor(model_dir, ctx)
    seen: dict[str, Any] = {
        "trainable": sorted(n for n, p in actor.model.named_parameters() if p.requires_grad),
        "optimized": sum(len(g["params"]) for g in actor.optimizer.param_groups),
        "dtensor_params": all(isinstance(p, DTensor) for p in actor.model.parameters()),
    }
    probe = actor.model.model.layers[0].self_attn.q_proj  # an adapted layer: its adapters' flag in a forward
    flags: list[bool] = []
    hook = probe.register_forward_pre_hook(
        lambda m, _: flags.append(m.lora_A["default"].weight.requires_grad)
    )
    tensors = {
        "ref_start": compute_logprobs(actor, inputs, micro_batch_size=2, reference=True),
        "start": compute_logprobs(actor, inputs, micro_batch_size=2),
    }
    hook.remove()
    seen["adapters_require_grad_in_forwards"] = flags
    prepared = prepare(actor, data, torch.tensor(ADVANTAGES), micro_batch_size=2, with_reference=True)
    objective = PolicyObjective(actor, prepared, StepSettings(update=UpdateSettings(kl_coef=0.1)))
    accumulate(objective, torch.arange(len(PROMPTS)), 2)
    seen["with_grad"] = sorted(n for n, p in actor.model.named_parameters() if p.grad is not None)
    seen["lora_B_grad_norm"] = sum(
        float(full(p.grad).norm()) for n, p in actor.model.named_parameters() if ".lora_B." in n
    )
    actor.optimizer.zero_grad(set_to_none=True)
    base = {n: full(p) for n, p in actor.model.named_parameters() if ".lora_" not in n}

    seen["updates"] = [train(actor, data) for _ in range(STEPS)]
    tensors["after"] = compute_logprobs(actor, inputs, micro_batch_size=2)
    tensors["ref_after"] = compute_logprobs(actor, inputs, micro_batch_size=2, reference=True)
    merged, seen["merged_bucket_bytes"] = buckets(actor, adapter=False)
    adapter, seen["adapter_bucket_bytes"] = buckets(actor, adapter=True)
    trained = {n: full(p) for n, p in actor.model.named_parameters()}
    seen["base_unchanged"] = all(torch.equal(trained[n], t) for n, t in base.items())
    actor.save_hf(out / "hf")

    save_checkpoint(out / "ckpt", actor, None, mode="full")
    seen["expected_update"] = train(actor, data)
    expected = adapters(actor)
    fresh = lora_actor(model_dir, ctx, seed=99)
    seen["loaded_step"] = load_checkpoint(out / "ckpt", fresh, None)
    seen["resumed_update"] = train(fresh, data)
    resumed = adapters(fresh)
    del fresh

    dpo = lora_actor(model_dir, ctx)
    seen["dpo"] = [dpo_step(dpo, dpo_batch()) for _ in range(2)]

    if ctx.is_main:
        tensors.update({f"merged/{n}": t for n, t in merged.items()})
        tensors.update({f"adapter/{n}": t for n, t in adapter.items()})
        tensors.update({f"trained/{n}": t for n, t in trained.items()})
        tensors.update({f"expected/{n}": t for n, t in expected.items()})
        tensors.update({f"resumed/{n}": t for n, t in resumed.items()})
        save_file(tensors, str(out / "tensors.safetensors"))
        (out / "seen.json").write_text(json.dumps(seen))
    sizes = {"merged": seen["merged_bucket_bytes"], "adapter": seen["adapter_bucket_bytes"]}
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(sizes))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
