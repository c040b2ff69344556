"""A reward worker the embedded launcher restarts keeps the run's reward (issue 12, point 5).

Tiny GRPO through real processes: after step 1 the run switches to a reward with a tiny reward
model and a normalizing scaler (``set_reward_fn``), then swaps the reward model
(``update_reward_model(dir)``); step 2 scores with both. The reward worker is SIGKILLed between
steps; the launcher starts it again on the run's reward ``state_dir``, and step 3 scores with the
swapped model and the scaler's statistics as they were before the kill, plus step 3's batch.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
BATCH = 4 * 4  # rollout_batch_size x group_size: the scores a step folds into the scaler


def _tiny_rm(folder: Path, seed: int) -> Path:
    spec = importlib.util.spec_from_file_location(
        "rlfleet_reward_fixtures", REPO / "tests/reward/conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    build: Callable[..., Path] = module.build_tiny_rm
    return build(folder, num_labels=1, seed=seed)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_restarted_reward_worker_serves_the_swapped_model_and_the_scaler_statistics(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig

    rm1, rm2 = _tiny_rm(tmp_path / "rm1", 3), _tiny_rm(tmp_path / "rm2", 4)
    out = tmp_path / "run"
    config = TrainerConfig(
        rollout_batch_size=4, train_batch_size=4, micro_batch_size=64, group_size=4, max_response_length=8,
        max_prompt_length=32, kl_coef=0.0, seed=0, output_dir=str(out), loggers=["jsonl"],
        sample_table_size=0,
    )  # fmt: skip
    dataset = PromptDataset(str(DATA), max_prompt_length=32)
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789", dataset, config)
    try:
        steps = trainer.steps(num_epochs=1, max_steps=3)
        next(steps)
        trainer.set_reward_fn({"spec": f"charset:allowed=0123456789 + 0.2*rm:path={rm1}",
                               "scaler": {"normalize": True}})  # fmt: skip
        trainer.update_reward_model(str(rm2))
        next(steps)
        before = trainer.reward_stats().endpoints["default"]
        assert f"path={rm2}" in before.spec and before.scaler_state is not None
        assert before.scaler_state["count"] == BATCH
        pids = procs.launched(out)
        os.kill(pids["reward-0"], signal.SIGKILL)
        third = next(steps)
        after = trainer.reward_stats().endpoints["default"]
        restarted = procs.launched(out)["reward-0"]
    finally:
        trainer.close()
    assert third.step == 3 and restarted != pids["reward-0"], "the launcher started it again"
    assert f"path={rm2}" in after.spec, f"the swapped model, not the original: {after.spec}"
    assert after.scaler_state is not None and after.scaler_state["count"] == 2 * BATCH, after.scaler_state
    assert after.scaler == before.scaler
    assert procs.survivors({**pids, "reward-0": restarted}) == []
