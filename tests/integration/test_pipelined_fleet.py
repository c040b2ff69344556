"""A pipelined run (``max_staleness: 1``) on the fleet's other shapes (issue 30, point 5): two rollout
pools, a pool scaled up and down mid-run, and the Ray launcher. Real processes throughout; in each,
the bound holds in every step from the recorded versions and every batch of the dataset's order is
trained once, in order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig
from rlfleet.controller.online import OnlineTrainer

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
BATCH = 4


def _trainer(model_dir: Path, out: Path, **overrides: Any) -> OnlineTrainer:
    config = TrainerConfig(**{
        "rollout_batch_size": BATCH, "train_batch_size": BATCH, "group_size": 4, "micro_batch_size": 64,
        "max_response_length": 8, "max_prompt_length": 32, "kl_coef": 0.0, "learning_rate": 3e-3,
        "output_dir": str(out), "loggers": ["jsonl"], "sample_table_size": 0, "seed": 0, "max_staleness": 1,
        **overrides,
    })  # fmt: skip
    return GRPOTrainer(
        str(model_dir),
        "charset:allowed=0123456789",
        PromptDataset(str(DATA), max_prompt_length=32, seed=0),
        config,
    )


def _run(trainer: OnlineTrainer, steps: int) -> tuple[list[list[int]], list[Any]]:
    trained, results = [], []
    for result in trainer.steps(num_epochs=1, max_steps=steps):
        rollout = trainer.online_step.last_rollout
        assert rollout is not None
        trained.append(sorted(item.index for item in rollout.items))
        results.append(result)
    return trained, results


def _check(out: Path, trained: list[list[int]], steps: int) -> list[dict[str, Any]]:
    order = PromptDataset(str(DATA), max_prompt_length=32, seed=0).batches(BATCH, epoch=0)
    assert trained == [sorted(item.index for item in batch) for batch in order][:steps]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert row["train/weight_version"] - row["rollout/weight_version_oldest"] <= 1, row
        assert row["rollout/staleness_over_bound"] == 0
    assert max(r["rollout/staleness_max"] for r in rows) == 1, "the fleet never generated ahead"
    return rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_pools(tmp_path: Path, tiny_model_dir: Path, procs: Any) -> None:
    trainer = _trainer(
        tiny_model_dir, tmp_path, rollout={"pools": {"a": {"engine": "hf"}, "b": {"engine": "hf"}}}
    )
    try:
        trained, results = _run(trainer, 4)
        pids = trainer.process_ids
    finally:
        trainer.close()
    assert procs.survivors(pids) == []
    _check(tmp_path, trained, 4)
    assert {w for r in results for w in r.routes["any"].workers} == {"rollout-a-0", "rollout-b-0"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_routing_by_a_rollout_fn(tmp_path: Path, tiny_model_dir: Path, procs: Any) -> None:
    """Each prompt routed by a rollout fn to a pool, or answered by the fn itself, while batches are
    generated a step ahead: every route served, the bound kept."""
    trainer = _trainer(
        tiny_model_dir, tmp_path, rollout={"pools": {"a": {"engine": "hf"}, "b": {"engine": "hf"}}}
    )
    trainer.set_rollout_fn(
        lambda item: "12345" if item.index % 3 == 0 else ("a" if item.index % 3 == 1 else "b")
    )
    try:
        trained, results = _run(trainer, 4)
        pids = trainer.process_ids
    finally:
        trainer.close()
    assert procs.survivors(pids) == []
    _check(tmp_path, trained, 4)
    for result in results:
        for route, summary in result.routes.items():
            assert all((row % 3, route) in {(0, "text"), (1, "a"), (2, "b")} for row in summary.rows), route
    assert {route for r in results for route in r.routes} == {"text", "a", "b"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pool_scaled_up_and_down_mid_run(tmp_path: Path, tiny_model_dir: Path, procs: Any) -> None:
    trainer = _trainer(tiny_model_dir, tmp_path, rollout={"scale": {2: {"default": 2}, 4: {"default": 1}}})
    try:
        trained, results = _run(trainer, 5)
        launched = procs.launched(tmp_path)
        pids = trainer.process_ids
    finally:
        trainer.close()
    assert procs.survivors(pids) == []
    _check(tmp_path, trained, 5)
    served = {w for r in results for w in r.routes["any"].workers}
    assert served == {"rollout-0", "rollout-1"} and "rollout-1" not in launched  # joined, then drained


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_ray_launcher(tmp_path: Path, tiny_model_dir: Path) -> None:
    from rlfleet.controller.ray_launcher import import_ray

    import_ray(local=True)
    trainer = _trainer(tiny_model_dir, tmp_path, launcher={"type": "ray", "num_cpus": 4})
    try:
        trained, _ = _run(trainer, 4)
    finally:
        trainer.close()
    _check(tmp_path, trained, 4)
