"""A trainer killed mid-run (issue 12, point 5): restored from the last checkpoint, or a named stop.

Tiny GRPO through real processes. With ``save_every=2`` the trainer is SIGKILLed during one of
steps 4-6: the run starts it again, restores the latest checkpoint (weights under a new version,
which the rollout worker loads), runs the steps after it again and finishes; a replayed step
equals its first run (same weights, prompts and sampling seed). With no checkpoint written yet
the run stops with :class:`TierNotRestarted` saying so (no ``save_every`` at all:
tests/integration/test_failures.py).
"""

from __future__ import annotations

import os
import signal
import threading
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


def _kill_soon(pid: int, delay: float) -> threading.Timer:
    timer = threading.Timer(delay, os.kill, (pid, signal.SIGKILL))
    timer.start()
    return timer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_trainer_is_restored_from_the_last_checkpoint(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    out = tmp_path / "run"
    trainer = _trainer(tiny_model_dir, out, save_every=2)
    try:
        steps = trainer.steps(num_epochs=3, max_steps=6)
        results = [next(steps) for _ in range(3)]
        assert (out / "checkpoint-2" / "controller_state.json").is_file()
        before = procs.launched(out)
        killer = _kill_soon(before["trainer-0"], 0.2)  # lands in one of steps 4-6
        results += list(steps)
        killer.join()
        after = procs.launched(out)
    finally:
        trainer.close()
    seen = [r.step for r in results]
    back = next(i for i in range(1, len(seen)) if seen[i] <= seen[i - 1])  # the first replayed step
    restored = seen[back] - 1
    assert restored in (2, 4) and seen == [*range(1, seen[back - 1] + 1), *range(restored + 1, 7)], seen
    assert trainer.global_step == 6 and (out / "checkpoint-6" / "controller_state.json").is_file()
    assert after["trainer-0"] != before["trainer-0"] and after["rollout-0"] == before["rollout-0"]
    first, again = results[restored].metrics, results[back].metrics  # the same step, before and after
    for key in KEYS:
        assert again[key] == pytest.approx(first[key], rel=1e-5, abs=1e-6), key
    assert results[back].weight_version > results[back - 1].weight_version, "restored weights: a new version"
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
