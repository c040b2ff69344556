"""Finding the checkpoint ``resume_from`` names: a path, or ``auto`` (the latest complete one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.controller.checkpoints import (
    CONTROLLER_STATE,
    TRAINER_STATE,
    forget_checkpoint_state,
    latest_checkpoint,
    resolve_resume,
)
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.errors import CheckpointNotFound


def _checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = root / f"checkpoint-{step}"
    (path / "trainer").mkdir(parents=True)
    if complete:
        (path / CONTROLLER_STATE).write_text("{}")
        (path / TRAINER_STATE).write_text("{}")
    return path


def test_a_save_over_a_checkpoint_forgets_its_controller_state_first(tmp_path: Path) -> None:
    """The trainer's new part may land and the controller's then fail: the old controller state
    must not stay beside it (issue 29, point 4)."""
    two = _checkpoint(tmp_path, 2)
    four = _checkpoint(tmp_path, 4)
    forget_checkpoint_state(four)  # what FleetRun.save_checkpoint does before the trainer saves
    (four / TRAINER_STATE).write_text("{}")  # the trainer's new save completes; the controller's fails
    assert latest_checkpoint(tmp_path) == two
    forget_checkpoint_state(tmp_path / "checkpoint-6")  # a first save: nothing to forget
    assert not (tmp_path / "checkpoint-6").exists()


def test_auto_takes_the_highest_complete_step(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2)
    ten = _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 12, complete=False)  # the run died while saving it
    (tmp_path / "checkpoint-x").mkdir()
    assert latest_checkpoint(tmp_path) == ten
    assert resolve_resume("auto", tmp_path) == ten
    assert resolve_resume(None, tmp_path) is None


def test_auto_without_checkpoints_starts_fresh(tmp_path: Path) -> None:
    assert resolve_resume("auto", tmp_path / "missing") is None
    assert resolve_resume("auto", tmp_path) is None


def test_a_named_checkpoint_must_be_complete(tmp_path: Path) -> None:
    two = _checkpoint(tmp_path, 2)
    assert resolve_resume(str(two), tmp_path / "elsewhere") == two
    broken = _checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(CheckpointNotFound, match="controller_state.json"):
        resolve_resume(str(broken), tmp_path)


def test_resume_from_is_a_config_field() -> None:
    assert TrainerConfig().resume_from is None
    assert TrainerConfig(resume_from="auto", save_every=5).resume_from == "auto"


def test_resume_re_applies_a_reward_switched_mid_run_unless_the_user_changed_it() -> None:
    from rlfleet.controller.checkpoints import reward_to_restore

    switched = {"reward_spec": "concise:max_words=30", "initial_reward_spec": "concise:max_words=80"}
    assert reward_to_restore(switched, "concise:max_words=80") == "concise:max_words=30"  # same script
    assert reward_to_restore(switched, "concise:max_words=30") is None  # already in force
    assert reward_to_restore(switched, "numeric") is None  # a deliberate change wins
    older = {"reward_spec": "numeric"}  # a checkpoint without the starting spec
    assert reward_to_restore(older, "numeric") is None
    assert reward_to_restore(older, "charset:allowed=01") is None
