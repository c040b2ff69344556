"""Run checkpoints every ``save_every`` steps, and ``resume_from`` one.

A checkpoint directory ``output_dir/checkpoint-<step>/`` holds::

    hf/                      HF export of the actor (AutoModelForCausalLM.from_pretrained)
    trainer/                 the trainer's state: sharded model + optimizer (DCP), schedulers, RNG
    controller_state.json    step, epoch, dataset position, KL controller, weight version, reward
                             spec (the one in force and the one the run started with), and the
                             reward scaler's options and running statistics when one is set

The trainer writes the first two (``trainer.save`` with ``mode="full"``), the controller the
last, once the trainer has replied, so a checkpoint with ``controller_state.json`` is complete.
Resuming restores the trainer (``trainer.load``), republishes the restored weights under their
saved version so the rollout workers serve them, then restores the controller's own position.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.controller.errors import CheckpointNotFound

if TYPE_CHECKING:
    from rlfleet.controller.runner import FleetRunner

logger = logging.getLogger(__name__)

CONTROLLER_STATE = "controller_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete ``checkpoint-<step>`` of ``output_dir`` with the highest step, or None."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), child)
        for child in root.iterdir()
        if (m := _CHECKPOINT.match(child.name)) and (child / CONTROLLER_STATE).exists()
    ]
    return max(found)[1] if found else None


def resolve_resume(resume_from: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint ``resume_from`` names: a path, or ``auto`` (latest one; None when there is none)."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        found = latest_checkpoint(output_dir)
        if found is None:
            logger.info("resume_from=auto: no checkpoint in %s, starting fresh", output_dir)
        return found
    path = Path(resume_from)
    if not (path / CONTROLLER_STATE).exists():
        raise CheckpointNotFound(str(path), f"it has no {CONTROLLER_STATE}")
    return path


def controller_state(runner: FleetRunner) -> dict[str, Any]:
    """What the controller must restore to continue: JSON-ready."""
    return {
        "global_step": runner.global_step,
        "epoch": runner.dataset.epoch,
        "dataset": runner.dataset.state_dict(),
        "kl_controller": runner.kl_controller.state_dict(),
        "weight_version": runner.weight_version,
        "reward_spec": runner.reward_spec,
        "initial_reward_spec": runner.initial_reward_spec,
        "reward_scaler": _scaler_in_force(runner),
    }


def _scaler_in_force(runner: FleetRunner) -> dict[str, Any] | None:
    """The reward endpoint's ``RewardScaler`` options and running statistics, if one is set."""
    if not runner.uses_rollouts:
        return None
    stats = runner.reward_stats().endpoints.get(runner.config.reward_endpoint)
    if stats is None or stats.scaler is None:
        return None
    return {"scaler": stats.scaler, "scaler_state": stats.scaler_state}


def save_run_checkpoint(runner: FleetRunner, path: str | Path) -> Path:
    """Have the trainer write its full state in ``path``, then write ``controller_state.json``."""
    root = Path(path).resolve()
    runner.run(runner.fleet.save(str(root), mode="full"))
    (root / CONTROLLER_STATE).write_text(json.dumps(controller_state(runner), indent=1))
    logger.info("checkpoint of step %d saved to %s", runner.global_step, root)
    return root


def resume_run(runner: FleetRunner, path: Path) -> None:
    """Restore the trainer from ``path``, serve its weights on the rollout tier, restore the controller."""
    state = json.loads((path / CONTROLLER_STATE).read_text())
    version = int(state["weight_version"])
    runner.run(_restore_tiers(runner, path.resolve(), version, runner.uses_rollouts))
    runner.dataset.load_state_dict(state["dataset"])
    runner.kl_controller.load_state_dict(state["kl_controller"])
    runner.global_step = int(state["global_step"])
    runner.weight_version = version
    runner._epoch = int(state["epoch"])
    if runner.uses_rollouts:
        _restore_reward(runner, state)
    logger.info("resumed from %s at step %d (weight version %d)", path, runner.global_step, version)


def _restore_reward(runner: FleetRunner, state: dict[str, Any]) -> None:
    """Re-apply the checkpoint's reward where the resumed run should continue with it: a spec switched
    mid-run (:func:`reward_to_restore`), and a ``RewardScaler``'s options and running statistics."""
    restore = reward_to_restore(state, runner.reward_spec)
    scaler = state.get("reward_scaler")
    in_force = state.get("reward_spec")
    if restore is None and (scaler is None or runner.reward_spec != in_force):
        return
    logger.info("re-applying the checkpoint's reward %r%s", in_force, " with its scaler" if scaler else "")
    runner.set_reward_fn({"spec": in_force, **(scaler or {})})


def reward_to_restore(state: dict[str, Any], this_run: Any) -> Any:
    """The reward spec to switch to on resume, or None to keep ``this_run``'s.

    A checkpoint records the spec the run started with and the one in force (``set_reward_fn``
    may have switched it). Resuming with the starting spec (the same script or job file) re-applies
    the one in force; resuming with any other spec is a deliberate change and keeps it.
    """
    saved = state.get("reward_spec")
    initial = state.get("initial_reward_spec", saved)
    if saved == this_run:
        return None
    if this_run == initial:
        return saved
    logger.warning("this run's reward spec %r differs from the checkpoint's (%r, started as %r); keeping "
                   "this run's", this_run, saved, initial)  # fmt: skip
    return None


async def _restore_tiers(runner: FleetRunner, path: Path, version: int, publish: bool) -> None:
    fleet = runner.fleet
    await fleet.load_checkpoint(str(path), version)
    if publish:
        cfg = runner.config
        published = await fleet.publish_weights(
            cfg.weight_bucket_mb,
            weight_version=version,
            carrier=cfg.weight_carrier,
            dtype=cfg.publish_dtype(),
        )
        await fleet.load_weights(published)
