"""Scoring streams inside a step (issue 30, point 1), through real processes: a tiny GRPO run
(library use: a private nats-server, a trainer, a reward worker and a rollout worker) whose rollout
fn answers each step's first prompt itself, so that chunk is ready at once while the rollout worker
still generates the rest.

The run goes twice with the same seed: as it runs (each chunk scored as it arrives), and with each
chunk's arrival hidden from the step (every chunk scored after generation: the order before
streaming). In the first, every step's first score started before its last chunk was generated;
in the second, none did; both runs log the same rewards, losses and weight versions, exactly.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
BATCH, GROUP, STEPS = 8, 4, 3
SAME = ("loss", "pg_loss", "entropy", "grad_norm", "reward/mean", "reward/std", "reward/max", "reward/min",
        "rollout/samples", "rollout/routed/text", "rollout/routed/any", "weight_version")  # fmt: skip


def _run(model_dir: Path, out: Path, *, streaming: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's ``metrics.jsonl`` rows, and per step when its scores started and generation ended."""
    from rlfleet.controller import GRPOTrainer, TrainerConfig

    config = TrainerConfig(
        rollout_batch_size=BATCH, train_batch_size=BATCH, micro_batch_size=64, group_size=GROUP,
        max_prompt_length=32, max_response_length=8, learning_rate=0.003, kl_coef=0.0, seed=0,
        output_dir=str(out), loggers=["jsonl"], sample_table_size=0, device="cpu",
    )  # fmt: skip
    trainer = GRPOTrainer(str(model_dir), "charset:allowed=0123456789", str(DATA), config)
    calls = itertools.count()
    trainer.set_rollout_fn(lambda item: ["1", "22", "333", "4444"] if next(calls) % BATCH == 0 else None)
    events: list[tuple[str, float]] = []
    timings: list[dict[str, Any]] = []
    try:
        trainer.start()
        fleet, router = trainer.fleet, trainer.online_step.router
        generate, score, route = fleet.generate, fleet.score, router.generate

        async def timed_generate(*args: Any, **kwargs: Any) -> Any:
            results = await generate(*args, **kwargs)
            events.append(("generated", time.perf_counter()))
            return results

        async def timed_score(*args: Any) -> Any:
            events.append(("score", time.perf_counter()))
            return await score(*args)

        async def unstreamed(*args: Any, on_chunk: Any = None) -> Any:
            return await route(*args)  # no chunk is told of: each scored after generation

        fleet.generate, fleet.score = timed_generate, timed_score  # type: ignore[method-assign]
        if not streaming:
            router.generate = unstreamed  # type: ignore[method-assign]
        for _ in trainer.steps(num_epochs=1, max_steps=STEPS):
            [generated] = [t for what, t in events if what == "generated"]  # the pool's; the fn's is no job
            timings.append({"generated": generated, "scores": [t for what, t in events if what == "score"]})
            events.clear()
        pids = trainer.process_ids
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, [{**t, "pids": pids} for t in timings]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_chunks_are_scored_while_generation_goes_on_and_the_run_is_the_same(
    tmp_path: Path, tiny_model_dir: Path, procs: Any
) -> None:
    streamed, streamed_times = _run(tiny_model_dir, tmp_path / "streamed", streaming=True)
    after, after_times = _run(tiny_model_dir, tmp_path / "after", streaming=False)

    assert [row["step"] for row in streamed] == [row["step"] for row in after] == list(range(1, STEPS + 1))
    for t in streamed_times:
        assert len(t["scores"]) == 2, "two chunks a step: the fn's texts and the rollout worker's"
        assert min(t["scores"]) < t["generated"], "the fn's chunk was scored while the rest generated"
    for t in after_times:
        assert min(t["scores"]) > t["generated"], "hidden arrivals: every chunk scored after generation"
    assert all(row["time/score_overlap_s"] > 0.0 for row in streamed)
    assert all(row["time/score_overlap_s"] == 0.0 for row in after)

    for ours, theirs in zip(streamed, after, strict=True):
        assert {k: ours[k] for k in SAME} == {k: theirs[k] for k in SAME}, ours["step"]
    assert procs.survivors(streamed_times[0]["pids"] + after_times[0]["pids"]) == []
