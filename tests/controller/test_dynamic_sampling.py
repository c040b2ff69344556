"""Dynamic sampling at the controller (issue 31, point 2): which groups a step keeps, how many batches
it takes to replace the dropped ones (never past the over-sampling budget), what it sends the
trainer (each chunk's kept groups and only their scores) and what it reports.

The step loop runs against the in-memory fleet of conftest.py, whose reward here gives every
sample of a prompt the same score when the prompt's ``digits`` are not a multiple of 3 (a flat
group) and different scores otherwise; the trainer's own row selection runs for real in
tests/integration/test_dynamic_sampling_run.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.control.messages import GenerateResult, ScoreResult
from rlfleet.common.schema.refs import TensorRef
from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig
from rlfleet.controller.dynamic_sampling import choose_groups, count_signal, wasted_token_frac
from rlfleet.controller.models import resolve_model

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "examples" / "data" / "tiny_digits.jsonl"
BATCH = 4


def _chunk(prompts: int, n: int = 2, tokens: int = 0) -> GenerateResult:
    ref = TensorRef(address="127.0.0.1:1", key="rollout/x")
    return GenerateResult(job_id="j", worker_id="rollout-0", weight_version=0, ref=ref, num_prompts=prompts,
                          num_samples=prompts * n, num_tokens=tokens)  # fmt: skip


def _scored(scores: list[float]) -> ScoreResult:
    return ScoreResult(job_id="s", endpoint="default", spec_version="v", scores=scores)


def test_the_first_groups_with_a_signal_are_kept_up_to_the_batch_size() -> None:
    results = [_chunk(3), _chunk(2)]
    # chunk 0: flat, signal, signal; chunk 1: signal, flat
    scored = [_scored([1, 1, 0, 1, 0.5, 0.25]), _scored([0, 1, 0.5, 0.5])]
    choice = choose_groups(results, scored, target=2, min_std=0.0, own_chunks=1)
    assert choice.groups == [[1, 2], []]  # the third group with a signal is surplus
    assert (choice.generated, choice.kept, choice.flat) == (5, 2, 2)
    assert choice.metrics(2) == {"groups/generated": 5.0, "groups/kept": 2.0, "groups/dropped": 3.0,
                                 "groups/dropped_flat": 2.0, "rollout/batches_generated": 2.0}  # fmt: skip
    assert choose_groups(results, scored, target=8, min_std=0.0, own_chunks=1).groups == [[1, 2], [0]]
    # a spread at or under min_std is no signal: std(0.5, 0.25) = 0.125
    assert choose_groups(results, scored, target=8, min_std=0.125, own_chunks=1).groups == [[1], [0]]
    assert count_signal(results, scored, 0.0) == 3 and count_signal(results, scored, 0.4) == 2


def test_with_no_signal_anywhere_the_step_trains_its_own_batch_whole() -> None:
    results = [_chunk(2), _chunk(1), _chunk(2)]
    scored = [_scored([1, 1, 0, 0]), _scored([3, 3]), _scored([0.5, 0.5, 2, 2])]
    choice = choose_groups(results, scored, target=4, min_std=0.0, own_chunks=2)
    assert choice.groups == [[0, 1], [0], []]
    assert (choice.generated, choice.kept, choice.flat) == (5, 3, 2)


def test_wasted_tokens_are_those_not_in_a_trained_group_with_a_signal() -> None:
    assert wasted_token_frac(30.0, [_chunk(2, tokens=40), _chunk(2, tokens=60)]) == pytest.approx(0.7)
    assert wasted_token_frac(0.0, [_chunk(2, tokens=0)]) == 0.0


def test_dynamic_sampling_is_for_algorithms_that_compare_a_prompts_samples() -> None:
    TrainerConfig(algorithm="rloo", dynamic_sampling={"enabled": True})
    with pytest.raises(ValueError, match="dynamic_sampling: ppo does not compare the samples of a prompt"):
        TrainerConfig(algorithm="ppo", dynamic_sampling={"enabled": True})
    with pytest.raises(ValueError, match="max_batches"):
        TrainerConfig(dynamic_sampling={"enabled": True, "max_batches": 0})


def _signal(item_metadata: dict[str, Any]) -> bool:
    return int(item_metadata["digits"]) % 3 == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("tiny:digits", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize("max_batches", [1, 3])
def test_dropped_groups_are_replaced_from_the_next_batches_within_the_budget(
    model_dir: Path, tmp_path: Path, fake_fleet: Any, attach_fleet: Any, max_batches: int
) -> None:
    class PromptScoredFleet(fake_fleet):  # type: ignore[misc, valid-type]
        async def score(self, results: list[Any], metadata: list[Any], endpoint: str) -> list[ScoreResult]:
            out = []
            for result, meta in zip(results, metadata, strict=True):
                n = result.num_samples // result.num_prompts
                scores = [float(j) if _signal(m) else 0.5 for m in meta for j in range(n)]
                out.append(ScoreResult(job_id="s", endpoint=endpoint, spec_version="v0", scores=scores))
            return out

    config = TrainerConfig(rollout_batch_size=BATCH, train_batch_size=BATCH, group_size=2, seed=0,
                           max_prompt_length=32, max_response_length=8, output_dir=str(tmp_path),
                           loggers=["jsonl"], sample_table_size=0,
                           dynamic_sampling={"enabled": True, "max_batches": max_batches})  # fmt: skip
    trainer = GRPOTrainer(str(model_dir), "charset:allowed=0123456789", str(PROMPTS), config)
    fleet = attach_fleet(trainer, PromptScoredFleet())
    steps, generated = [], []
    try:
        for result in trainer.steps(num_epochs=1, max_steps=5):
            assert trainer.online_step.last_rollout is not None
            generated.append(trainer.online_step.last_rollout.items)
            steps.append(result.metrics)
            position = trainer.fleet_run.dataset_position()  # what a checkpoint of this step saves
    finally:
        trainer.close()
    order = [b for b in PromptDataset(str(PROMPTS), max_prompt_length=32, seed=0).batches(BATCH, epoch=0)]
    used = 0
    for metrics, items, request in zip(steps, generated, fleet.train_requests, strict=True):
        batches = int(metrics["rollout/batches_generated"])
        assert 1 <= batches <= max_batches, "the over-sampling budget bounds every step"
        # the step's own batch, then the run's next ones, none twice, none skipped
        expected = [it.index for batch in order[used : used + batches] for it in batch]
        assert [it.index for it in items] == expected
        used += batches
        signal = [it for it in items if _signal(it.metadata)]
        kept = signal[:BATCH] or items[:BATCH]  # with no signal at all, the step's own batch whole
        assert batches == max_batches or len(signal) >= BATCH, "it stopped before the batch was full"
        before_last = [it for it in items[:-BATCH] if _signal(it.metadata)]
        assert batches == 1 or len(before_last) < BATCH, "it took a batch it did not need"
        assert metrics["groups/generated"] == len(items) and metrics["groups/kept"] == len(kept)
        assert metrics["groups/dropped"] == len(items) - len(kept)
        # what the trainer got: each chunk's kept groups (one chunk a batch here) and only their scores
        assert request.groups is not None and sum(len(g) for g in request.groups) == len(kept)
        assert len(request.rollouts) == len(request.groups) and all(request.groups)
        assert len(request.scores) == 2 * len(kept)
        if signal:
            assert request.scores == [0.0, 1.0] * len(kept), "only groups with a signal were sent"
    assert max(int(m["rollout/batches_generated"]) for m in steps) == max_batches
    if max_batches == 1:  # no budget to replace: flat groups are dropped, nothing more is sampled
        assert used == len(steps)
    # a checkpoint of the last step resumes after the last batch it used, extras included
    assert position["index"] == used * BATCH
