"""Dynamic sampling through real processes (issue 31, point 2): tiny GRPO runs (a private
nats-server, a trainer, a reward worker, a rollout worker; library use) whose reward gives every
sample of two prompts in three the same score, so most batches hold groups without a signal.

Each step takes the run's next batches until it holds ``rollout_batch_size`` groups with a signal
or its budget is spent, never more; the trainer trains exactly the kept groups (its own count of
groups and of flat groups says so: it selected the rows and their scores lined up); the batches are
used in the dataset's order, none twice. Pipelined (``max_staleness: 1``), the replacement is the
batch already in flight: nothing generated ahead is dropped and the staleness bound holds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
BATCH, BUDGET, STEPS = 4, 3, 4


def _has_signal(digits: str) -> bool:
    return int(digits) % 3 == 0


def reward(prompt: str, response: str, digits: str) -> float:
    """Flat (0 for every sample) unless the prompt's digits are a multiple of 3; then a score that
    differs between responses."""
    return (sum(map(ord, response)) % 7) / 7 if _has_signal(digits) else 0.0


def _run(
    model_dir: Path, out: Path, **overrides: Any
) -> tuple[list[dict[str, float]], list[list[Any]], list[int]]:
    config = TrainerConfig(
        rollout_batch_size=BATCH, train_batch_size=BATCH, group_size=4, micro_batch_size=64,
        max_response_length=8, max_prompt_length=32, kl_coef=0.0, learning_rate=1e-3, output_dir=str(out),
        loggers=["jsonl"], sample_table_size=0, seed=0,
        dynamic_sampling={"enabled": True, "max_batches": BUDGET}, **overrides,
    )  # fmt: skip
    trainer = GRPOTrainer(str(model_dir), reward, str(DATA), config)
    steps, items = [], []
    try:
        for result in trainer.steps(num_epochs=1, max_steps=STEPS):
            assert trainer.online_step.last_rollout is not None
            items.append(trainer.online_step.last_rollout.items)
            steps.append(result.metrics)
        pids = trainer.process_ids
    finally:
        trainer.close()
    return steps, items, pids


def _check(steps: list[dict[str, float]], items: list[list[Any]]) -> None:
    order = list(PromptDataset(str(DATA), max_prompt_length=32, seed=0).batches(BATCH, epoch=0))
    used = 0
    for metrics, generated in zip(steps, items, strict=True):
        batches = int(metrics["rollout/batches_generated"])
        assert 1 <= batches <= BUDGET
        assert [it.index for it in generated] == [it.index for b in order[used : used + batches] for it in b]
        used += batches
        prompts_with_signal = [it for it in generated if _has_signal(it.metadata["digits"])]
        assert batches == BUDGET or metrics["groups/kept"] == BATCH, "it stopped short of a full batch"
        assert metrics["groups/generated"] == len(generated)
        if prompts_with_signal:
            assert metrics["groups/kept"] <= min(BATCH, len(prompts_with_signal))
        # the trainer's own count over what it trained: the kept groups, none flat, unless no group had
        # a signal (then the step's own batch, every group flat)
        assert metrics["groups/total"] == metrics["groups/kept"]
        if metrics["groups/flat"]:
            assert metrics["groups/flat"] == metrics["groups/kept"] == BATCH
            assert metrics["groups/dropped_flat"] + BATCH == metrics["groups/generated"]
        assert 0.0 <= metrics["groups/wasted_token_frac"] <= 1.0
        if metrics["groups/dropped"]:
            assert metrics["groups/wasted_token_frac"] > 0.0
    assert any(m["rollout/batches_generated"] > 1 for m in steps), "no group was ever replaced"
    assert sum(m["groups/dropped_flat"] for m in steps) > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dropped_groups_are_replaced_within_the_budget_and_the_trainer_trains_the_kept(
    tmp_path: Path, tiny_model_dir: Path, procs: Any
) -> None:
    steps, items, pids = _run(tiny_model_dir, tmp_path)
    assert procs.survivors(pids) == []
    _check(steps, items)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipelined_replacements_come_from_the_stream(
    tmp_path: Path, tiny_model_dir: Path, procs: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="rlfleet.controller.rollout_ahead"):
        steps, items, pids = _run(tiny_model_dir, tmp_path, max_staleness=1)
    assert procs.survivors(pids) == []
    _check(steps, items)
    assert "dropping" not in caplog.text, "a batch generated ahead was thrown away"
    for row in steps:
        assert row["rollout/staleness_max"] <= 1 and row["rollout/staleness_over_bound"] == 0
    assert max(r["rollout/staleness_max"] for r in steps) == 1, "the fleet never generated ahead"
