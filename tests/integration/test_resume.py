"""Exact resume: a run stopped at a checkpoint and resumed repeats the uninterrupted run's steps.

Tiny GRPO on CPU (HF engine, fixed seed), through real processes: four steps uninterrupted with
``save_every=2``; then two steps, stop, and a fresh run with ``resume_from`` that checkpoint for
two more. The resumed steps' losses and rewards equal the uninterrupted run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
KEYS = ("loss", "pg_loss", "entropy", "grad_norm", "reward/mean", "reward/std", "weight_version")


def _run(
    model_dir: Path, out: Path, max_steps: int, resume_from: str | None = None
) -> list[dict[str, float]]:
    from rlfleet.controller import GRPOTrainer, TrainerConfig

    config = TrainerConfig(
        rollout_batch_size=8, train_batch_size=8, micro_batch_size=64, group_size=4, max_prompt_length=32,
        max_response_length=8, learning_rate=0.003, kl_coef=0.0, seed=0, output_dir=str(out),
        loggers=["jsonl"], sample_table_size=0, save_every=2, resume_from=resume_from, device="cpu",
    )  # fmt: skip
    trainer = GRPOTrainer(str(model_dir), "charset:allowed=0123456789", str(DATA), config)
    return [{"step": r.step, **r.metrics} for r in trainer.train(num_epochs=3, max_steps=max_steps)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resumed_steps_equal_the_uninterrupted_run(tmp_path: Path, tiny_model_dir: Path, procs) -> None:
    full = _run(tiny_model_dir, tmp_path / "full", max_steps=4)
    first = _run(tiny_model_dir, tmp_path / "cut", max_steps=2)
    ckpt = tmp_path / "cut" / "checkpoint-2"
    state = json.loads((ckpt / "controller_state.json").read_text())
    assert state["global_step"] == 2 and state["weight_version"] == 2
    assert state["dataset"]["index"] == 16 and state["reward_spec"] == "charset:allowed=0123456789"
    assert (ckpt / "trainer" / "actor").is_dir() and (ckpt / "trainer" / "state.json").is_file()
    assert AutoModelForCausalLM.from_pretrained(ckpt / "hf").config.vocab_size > 0

    rest = _run(tiny_model_dir, tmp_path / "cut", max_steps=4, resume_from="auto")
    assert [row["step"] for row in full] == [1, 2, 3, 4]
    assert [row["step"] for row in first + rest] == [1, 2, 3, 4]
    for ours, theirs in zip(first + rest, full, strict=True):
        for key in KEYS:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-7), (ours["step"], key)
    assert (tmp_path / "cut" / "checkpoint-4" / "controller_state.json").is_file()
    logged = [
        json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    ]
    assert logged == [1, 2, 3, 4]  # the resumed run appends to the steps before its checkpoint
    assert procs.survivors(procs.launched(tmp_path / "cut")) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reward_switched_mid_run_is_in_force_after_resume(tmp_path: Path, tiny_model_dir: Path) -> None:
    """set_reward_fn at step 1 (a spec with a normalizing RewardScaler), checkpoint at step 2; the same
    script resumed scores with the switched spec and the scaler's running statistics of the checkpoint
    (the reward tier is told again). A script with another spec keeps its own (unit-tested)."""
    from rlfleet.controller import GRPOTrainer, TrainerConfig
    from rlfleet.reward import RewardScaler, build_reward

    def trainer(out: Path, spec: str, resume_from: str | None = None) -> GRPOTrainer:
        config = TrainerConfig(
            rollout_batch_size=8, train_batch_size=8, micro_batch_size=64, group_size=4, max_prompt_length=32,
            max_response_length=8, kl_coef=0.0, seed=0, output_dir=str(out), loggers=["jsonl"],
            sample_table_size=0, save_every=2, resume_from=resume_from,
        )  # fmt: skip
        return GRPOTrainer(str(tiny_model_dir), spec, str(DATA), config)

    first = trainer(tmp_path / "run", "charset:allowed=0123456789")
    try:
        for result in first.steps(num_epochs=1, max_steps=2):
            if result.step == 1:
                first.set_reward_fn(RewardScaler(fn=build_reward("charset:allowed=0"), normalize=True))
                switched = first.reward_spec
    finally:
        first.close()
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "controller_state.json").read_text())
    assert state["reward_spec"] == switched and switched["components"][0]["args"]["allowed"] == "0"
    assert state["initial_reward_spec"] == "charset:allowed=0123456789"
    saved = state["reward_scaler"]
    assert saved["scaler"]["normalize"] is True and saved["scaler_state"]["count"] == 32, saved

    again = trainer(tmp_path / "run", "charset:allowed=0123456789", resume_from="auto")
    try:
        again.start()
        assert again.global_step == 2 and again.reward_spec == switched
        served = again.reward_stats().endpoints["default"]
        assert served.spec == "charset:allowed='0',case_sensitive=true", served.spec
        assert served.scaler is not None and served.scaler["normalize"] is True
        assert served.scaler_state == saved["scaler_state"], "the running statistics continue"
    finally:
        again.close()
