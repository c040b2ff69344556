"""Run checkpoints every ``save_every`` steps, and ``resume_from`` one.

A checkpoint directory ``output_dir/checkpoint-<step>/`` holds::

    hf/                      HF export of the actor (AutoModelForCausalLM.from_pretrained)
    trainer/                 the trainer's state: sharded model + optimizer (DCP), schedulers, RNG
    controller_state.json    step, epoch, dataset position, KL controller, weight version, reward
                             spec (the one in force and the one the run started with), and the
                             reward scaler's options and running statistics when one is set

The trainer writes the first two (``trainer.save`` with ``mode="full"``), the controller the
last, once the trainer has replied. A checkpoint is complete when it has both markers:
``controller_state.json`` and the trainer's ``trainer/state.json``, which a trainer's save removes
before it writes anything and writes last (:mod:`rlfleet.trainer.checkpoint`), so a save that
failed partway, even one over an older checkpoint of the same step, is never taken for complete.
Resuming restores the trainer (``trainer.load``), republishes the restored weights under their
saved version so the rollout workers serve them, then restores the controller's own position
(:class:`~rlfleet.controller.run.FleetRun` does both; this module finds and reads checkpoints).
The same restores a trainer that crashed mid-run (:mod:`rlfleet.controller.supervision`), and
``resume_from=auto`` continues a run whose controller was killed outright: ``controller_state.json``
is written atomically (:func:`~rlfleet.common.atomic_files.write_atomic`), so a checkpoint cut
short by the kill has none and is skipped.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from rlfleet.common.atomic_files import sync_dir, write_atomic
from rlfleet.controller.errors import CheckpointNotFound

logger = logging.getLogger(__name__)

CONTROLLER_STATE = "controller_state.json"
TRAINER_STATE = "trainer/state.json"
"""The trainer's completion marker inside a checkpoint (``rlfleet.trainer.checkpoint.STATE_FILE`` under
``trainer/``; the controller does not import the trainer)."""
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def missing_markers(path: Path) -> list[str]:
    """What ``path`` lacks to be a complete checkpoint: ``[]`` when it holds both markers."""
    return [name for name in (CONTROLLER_STATE, TRAINER_STATE) if not (path / name).is_file()]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete ``checkpoint-<step>`` of ``output_dir`` with the highest step, or None."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), child)
        for child in root.iterdir()
        if (m := _CHECKPOINT.match(child.name)) and not missing_markers(child)
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
    missing = missing_markers(path)
    if missing:
        raise CheckpointNotFound(str(path), f"it has no {' and no '.join(missing)} (an incomplete save)")
    return path


def forget_checkpoint_state(path: Path) -> None:
    """Remove ``controller_state.json`` from ``path`` before a save into it begins: a save over an
    older checkpoint of the same step whose controller part then fails must not leave the old
    controller state beside the new trainer state, a pair that looks complete."""
    (path / CONTROLLER_STATE).unlink(missing_ok=True)
    if path.is_dir():
        sync_dir(path)


def write_checkpoint_state(path: Path, state: dict[str, Any]) -> None:
    """Write ``controller_state.json`` in ``path``, once the trainer has saved its part there:
    atomically, so that a controller killed while writing leaves no checkpoint that looks complete."""
    write_atomic(path / CONTROLLER_STATE, json.dumps(state, indent=1))


def read_checkpoint_state(path: Path) -> dict[str, Any]:
    """The controller's state saved in the checkpoint ``path``."""
    return json.loads((path / CONTROLLER_STATE).read_text())


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
