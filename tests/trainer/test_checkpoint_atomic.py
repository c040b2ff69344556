"""Checkpoints are all or nothing (issue 29, point 4): a save that fails partway leaves no
completion marker (``trainer/state.json``, which ``resume_from=auto`` needs: tests/controller),
even one written over an older checkpoint of the same step, and a load that fails partway leaves
the model, optimizer, schedulers and RNGs as they were. Real actors and critics (tiny model,
CPU), real DCP files.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from batches import update  # this folder's helper module (conftest puts it on sys.path)
from torch.distributed.checkpoint.api import CheckpointException

from rlfleet.trainer.actor import Actor
from rlfleet.trainer.checkpoint import STATE_FILE, check_loadable, load_checkpoint, save_checkpoint
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.errors import CheckpointError

PROMPTS, RESPONSES = [3, 5, 2, 4], [4, 2, 5, 3]
OPTIM = {"learning_rate": 1e-2, "weight_decay": 0.01, "warmup_steps": 3}


def _train(actor: Actor, batch: dict[str, torch.Tensor], scale: float) -> None:
    update(actor, batch, torch.tensor([1.0, -1.0, 0.5, -0.5]) * scale, micro_batch_size=2, num_updates=1)


def _snapshot(actor: Actor) -> dict[str, object]:
    """Everything a load restores, copied."""
    optim = actor.optimizer.state_dict()
    return {
        "model": {k: v.detach().clone() for k, v in actor.model.state_dict().items()},
        "optim": {
            k: {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in s.items()}
            for k, s in optim["state"].items()
        },  # fmt: skip
        "groups": [dict(g) for g in optim["param_groups"]],
        "scheduler": actor.scheduler.state_dict()["last_epoch"],
        "steps": actor.steps,
        "rng": (torch.get_rng_state().clone(), random.getstate()),
    }


def _assert_unchanged(actor: Actor, before: dict[str, object]) -> None:
    now = _snapshot(actor)
    for name, tensor in now["model"].items():  # type: ignore[union-attr]
        assert torch.equal(tensor, before["model"][name]), f"model {name} changed by the failed load"  # type: ignore[index]
    assert now["optim"].keys() == before["optim"].keys()  # type: ignore[union-attr]
    for key, state in now["optim"].items():  # type: ignore[union-attr]
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(before["optim"][key][name])), (
                key,
                name,
            )  # type: ignore[index]
    assert now["groups"] == before["groups"]
    assert (now["scheduler"], now["steps"]) == (before["scheduler"], before["steps"])
    assert torch.equal(now["rng"][0], before["rng"][0]) and now["rng"][1] == before["rng"][1]  # type: ignore[index]


def _damage(part_dir: Path) -> None:
    """Cut every shard file of a DCP part short: its metadata reads, its tensors do not."""
    shards = list(part_dir.glob("*.distcp"))
    assert shards
    for shard in shards:
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 3])


@pytest.mark.timeout(120)
def test_a_load_whose_critic_part_is_damaged_leaves_the_actor_as_it_was(
    tiny_model_dir: Path, make_batch: Callable, tmp_path: Path
) -> None:
    batch = make_batch(PROMPTS, RESPONSES)
    actor, critic = Actor(tiny_model_dir, seed=5, **OPTIM), Critic(tiny_model_dir, seed=5, **OPTIM)
    _train(actor, batch, 1.0)
    save_checkpoint(tmp_path / "ckpt", actor, critic, mode="full")
    _damage(tmp_path / "ckpt" / "trainer" / "critic")  # read after the actor's part

    other = Actor(tiny_model_dir, seed=7, **OPTIM)
    _train(other, batch, -2.0)  # a trainer mid-run: its own weights, optimizer moments, schedule
    before = _snapshot(other)
    check_loadable(tmp_path / "ckpt", critic)  # every file is there: only reading the part finds the damage
    with pytest.raises(CheckpointException, match="corrupted"):
        load_checkpoint(tmp_path / "ckpt", other, Critic(tiny_model_dir, seed=7, **OPTIM))
    _assert_unchanged(other, before)


@pytest.mark.timeout(120)
def test_a_save_that_fails_partway_over_an_older_checkpoint_is_never_the_latest(
    tiny_model_dir: Path, make_batch: Callable, tmp_path: Path
) -> None:
    batch = make_batch(PROMPTS, RESPONSES)
    actor, critic = Actor(tiny_model_dir, seed=5, **OPTIM), Critic(tiny_model_dir, seed=5, **OPTIM)
    one, two = tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"
    for step, path in ((1, one), (2, two)):
        _train(actor, batch, float(step))
        save_checkpoint(path, actor, critic, mode="full")
    assert (two / "trainer" / STATE_FILE).is_file()

    # a later run saves step 2 again (resumed from checkpoint-1); its save breaks off after the actor
    _train(actor, batch, 3.0)
    shutil.rmtree(two / "trainer" / "critic")
    (two / "trainer" / "critic").write_text("in the way")
    with pytest.raises(CheckpointException, match="critic"):
        save_checkpoint(two, actor, critic, mode="full")
    # the trainer's completion marker is gone (the controller's resume_from=auto needs it: tests/controller)
    assert not (two / "trainer" / STATE_FILE).exists(), "a half-written save kept its marker"
    assert (one / "trainer" / STATE_FILE).is_file()
    with pytest.raises(CheckpointError, match="state.json"):
        check_loadable(two, critic)
