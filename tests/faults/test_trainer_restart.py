"""A trainer killed mid-run (issue 12, point 5): restored from the last checkpoint, or a named stop.

Tiny GRPO through real processes. With ``save_every=2`` the trainer is SIGKILLed after step 5
answered: the run starts it again, restores the latest checkpoint (weights under a new version,
which the rollout worker loads), runs the steps after it again and finishes; a replayed step
equals its first run (same weights, prompts and sampling seed). With no checkpoint written yet
the run stops with :class:`TierNotRestarted` saying so (no ``save_every`` at all:
tests/integration/test_failures.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig
from rlfleet.controller.errors import TierNotRestarted

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
KEYS = ("loss", "pg_loss", "grad_norm", "reward/mean")


def _trainer(model_dir: Path, out: Path, **overrides: object) -> GRPOTrainer:
    settings: dict[str, object] = {
        "rollout_batch_size": 4, "train_batch_size": 4, "micro_batch_size": 64, "group_size": 4,
        "max_response_length": 8, "max_prompt_length": 32, "kl_coef": 0.0, "learning_rate": 3e-3,
        "output_dir": str(out), "loggers": ["jsonl"], "sample_table_size": 0, "seed": 0,
    }  # fmt: skip
    settings.update(overrides)
    dataset = PromptDataset(str(DATA), max_prompt_length=32)
    return GRPOTrainer(str(model_dir), "charset:allowed=0123456789", dataset, TrainerConfig(**settings))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_trainer_is_restored_from_the_last_checkpoint(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    out = tmp_path / "run"
    trainer = _trainer(tiny_model_dir, out, save_every=2)
    try:
        steps = trainer.steps(num_epochs=3, max_steps=6)
        results = [next(steps) for _ in range(5)]
        assert (out / "checkpoint-4" / "controller_state.json").is_file()
        before = procs.launched(out)
        # Killed after step 5 answered, before step 6 is trained: step 5's update is lost with the
        # process (checkpoint-4 is the latest), so the run restores checkpoint-4 and runs 5 again.
        os.kill(before["trainer-0"], signal.SIGKILL)
        results += list(steps)
        after = procs.launched(out)
    finally:
        trainer.close()
    seen = [r.step for r in results]
    assert seen == [1, 2, 3, 4, 5, 5, 6], seen
    assert trainer.global_step == 6 and (out / "checkpoint-6" / "controller_state.json").is_file()
    assert after["trainer-0"] != before["trainer-0"] and after["rollout-0"] == before["rollout-0"]
    first, again = results[4].metrics, results[5].metrics  # step 5, before and after the restore
    for key in KEYS:
        assert again[key] == pytest.approx(first[key], rel=1e-5, abs=1e-6), key
    assert results[5].weight_version > results[4].weight_version, "restored weights: a new version"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6], "metrics.jsonl holds each step once"
    assert rows[4]["loss"] == pytest.approx(again["loss"], rel=1e-5, abs=1e-6), "step 5's line: the replay's"
    assert procs.survivors({**before, **after}) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_trainer_with_no_checkpoint_yet_stops_the_run_naming_why(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    out = tmp_path / "run"
    trainer = _trainer(tiny_model_dir, out, save_every=50)
    steps = trainer.steps(num_epochs=1, max_steps=10)
    next(steps)
    pids = procs.launched(out)
    os.kill(pids["trainer-0"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TierNotRestarted) as caught:
        next(steps)
    assert time.monotonic() - t0 < 60
    message = str(caught.value)
    assert message.startswith("trainer worker trainer-0 was killed by signal SIGKILL")
    why = "the run cannot restore the trainer: no checkpoint is written yet (save_every=50, at step 1)"
    assert why in message
    assert procs.survivors(pids) == []
