"""Progressive reward in the embedded default: the run's own reward worker switches mid-run.

A tiny GRPO run (its own nats-server, trainer, rollout and reward processes) starts on a rule
reward, moves to ``scaler.compute_reward`` after step 1 and to a reward model after step 2
(``update_reward_model`` with a spec that holds an ``rm`` component), then swaps only the reward
model's directory. The metrics name each version change at its step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reward_changes_mid_run_with_the_embedded_reward_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_tiny_rm: Callable[..., Path]
) -> None:
    from rlfleet.controller import GRPOTrainer, TrainerConfig
    from rlfleet.reward import RewardScaler, build_reward

    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path / "cache"))
    rm1, rm2 = make_tiny_rm(num_labels=1, seed=3), make_tiny_rm(num_labels=1, seed=4)
    config = TrainerConfig(
        rollout_batch_size=8, train_batch_size=8, micro_batch_size=64, group_size=4, max_prompt_length=32,
        max_response_length=8, learning_rate=0.003, kl_coef=0.0, seed=0, output_dir=str(tmp_path / "run"),
        loggers=["jsonl"], sample_table_size=0,
    )  # fmt: skip
    trainer = GRPOTrainer("tiny:digits", "charset:allowed=0123456789", str(DATA), config)
    try:
        for result in trainer.steps(max_steps=4):
            if result.step == 1:
                scaler = RewardScaler(fn=build_reward("charset:allowed=0123456789"), temperature=0.5)
                trainer.set_reward_fn(scaler.compute_reward)  # described: the reward worker serves it
            if result.step == 2:
                trainer.update_reward_model(f"charset:allowed=0123456789 + 0.2*rm:path={rm1}")
            if result.step == 3:
                version = trainer.update_reward_model(str(rm2))
                assert version.endswith("-r3")
        assert f"path={rm2}" in trainer.reward_stats().endpoints["default"].spec
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["reward/spec_revision"] for row in rows] == [0, 1, 2, 3]
    assert [row["reward/spec_version_changed"] for row in rows] == [0, 1, 1, 1]
    assert "reward/raw_mean" in rows[1] and "reward/raw_mean" in rows[3], "the scaler stays through swaps"
    assert all(f"reward/{name}" in rows[3] for name in ("charset", "rm")), "each component is reported"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_swapped_reward_model_is_in_force_after_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_tiny_rm: Callable[..., Path]
) -> None:
    """update_reward_model(dir) at step 1, checkpoint at step 2: the same script resumed from it
    scores with the swapped-in model (the checkpoint keeps the swap, not only the spec)."""
    from rlfleet.controller import GRPOTrainer, TrainerConfig

    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path / "cache"))
    rm1, rm2 = make_tiny_rm(num_labels=1, seed=3), make_tiny_rm(num_labels=1, seed=4)
    spec = f"charset:allowed=0123456789 + 0.2*rm:path={rm1}"

    def trainer(resume_from: str | None = None) -> GRPOTrainer:
        config = TrainerConfig(
            rollout_batch_size=8, train_batch_size=8, micro_batch_size=64, group_size=4, max_prompt_length=32,
            max_response_length=8, kl_coef=0.0, seed=0, output_dir=str(tmp_path / "run"), loggers=["jsonl"],
            sample_table_size=0, save_every=2, resume_from=resume_from,
        )  # fmt: skip
        return GRPOTrainer("tiny:digits", spec, str(DATA), config)

    first = trainer()
    try:
        for result in first.steps(max_steps=2):
            if result.step == 1:
                first.update_reward_model(str(rm2))
    finally:
        first.close()
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "controller_state.json").read_text())
    assert state["reward_spec"] == spec and state["reward_model"]["model_path"] == str(rm2), state

    again = trainer(resume_from="auto")
    try:
        again.start()
        assert again.global_step == 2
        served = again.reward_stats().endpoints["default"].spec
        assert f"path={rm2}" in served and f"path={rm1}" not in served, served
    finally:
        again.close()
