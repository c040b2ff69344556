"""One rank of the 2-rank gloo checkpoint test (run as a script, with the torchrun variables set).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python checkpoint_ranks.py MODEL OUT

Under FSDP2 on the CPU: an actor takes one update (shuffled mini-batches), saves its training state
(sharded DCP) to ``OUT/ckpt``, takes a second update and gathers its parameters; a fresh actor
loads ``OUT/ckpt``, takes the same second update and gathers its parameters. Rank 0 writes both
to ``OUT/expected.safetensors`` and ``OUT/resumed.safetensors``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlfleet.trainer.actor import Actor
from rlfleet.trainer.checkpoint import load_training_state, save_training_state
from rlfleet.trainer.distributed import init_distributed

sys.path.insert(0, str(Path(__file__).parent))
from batches import contract_batch, update  # noqa: E402  (this folder's helper module)

PROMPTS, RESPONSES = [3, 5, 2, 4, 5], [4, 2, 6, 1, 3]


def _batch() -> dict[str, torch.Tensor]:
    return contract_batch(PROMPTS, RESPONSES, seed=3)


def _update(actor: Actor, batch: dict[str, torch.Tensor], scale: float) -> None:
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3]) * scale
    update(actor, batch, adv, micro_batch_size=2, num_updates=2)  # mini-batches of 3 and 2


def _gathered(actor: Actor) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for bucket in actor.iter_weight_buckets(1 << 30):
        state.update({k: v.clone() for k, v in bucket.items()})
    return state


def main(model_dir: str, out_dir: str) -> None:
    out = Path(out_dir)
    ctx = init_distributed(device="cpu", sharding="full")
    optim = {"learning_rate": 1e-2, "weight_decay": 0.01, "warmup_steps": 2}
    batch = _batch()
    actor = Actor(model_dir, None, ctx, seed=11, **optim)
    _update(actor, batch, 1.0)
    save_training_state(out / "ckpt", actor, generator=actor.generator)
    _update(actor, batch, 2.0)
    expected = _gathered(actor)
    fresh = Actor(model_dir, None, ctx, seed=99, **optim)
    load_training_state(out / "ckpt", fresh, generator=fresh.generator)
    _update(fresh, batch, 2.0)
    resumed = _gathered(fresh)
    if ctx.is_main:
        save_file(expected, str(out / "expected.safetensors"))
        save_file(resumed, str(out / "resumed.safetensors"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
