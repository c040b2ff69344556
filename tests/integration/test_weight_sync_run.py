"""Delta sync and verified loads through real processes (issue 32, points 3 and 4): tiny GRPO runs
(a private nats-server, a trainer, a reward worker, two rollout workers; library use).

With ``weight_sync.delta`` the trainer stages each version whole and as its change from the version
before; a rollout worker that holds the version before pulls only the change, writes it into its
copy and loads the result. Every load answers a fingerprint of what the worker loaded, which the
controller holds against the trainer's fingerprint of the whole version: a delta-synced worker
passing it holds the published weights bit for bit. A sync broken on purpose (a bucket dropped on
the way) is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlfleet.controller import GRPOTrainer, TrainerConfig
from rlfleet.controller.errors import WeightSyncMismatch

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
REWARD = "charset:allowed=0123456789"


def _trainer(model_dir: Path, out: Path, **overrides: Any) -> GRPOTrainer:
    config = TrainerConfig(**{
        "rollout_batch_size": 4, "train_batch_size": 4, "group_size": 4, "micro_batch_size": 64,
        "max_response_length": 8, "max_prompt_length": 32, "kl_coef": 0.0, "learning_rate": 1e-5,
        "output_dir": str(out), "loggers": ["jsonl"], "sample_table_size": 0, "seed": 0,
        "rollout": {"workers": 2, "dtype": "bfloat16", "engine": "hf"}, "weight_bucket_mb": 0.05, **overrides,
    })  # fmt: skip
    return GRPOTrainer(str(model_dir), REWARD, str(DATA), config)


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("engine", "dtype"), [("hf", "bfloat16"), ("vllm", "float32")])
def test_delta_synced_workers_hold_the_published_weights_bit_for_bit(
    tmp_path: Path, tiny_model_dir: Path, procs: Any, engine: str, dtype: str
) -> None:
    if engine == "vllm":
        pytest.importorskip("vllm")
    trainer = _trainer(tiny_model_dir, tmp_path, weight_sync={"delta": True, "anchor_every": 3},
                       rollout={"workers": 2, "dtype": dtype, "engine": engine},
                       learning_rate=1e-6)  # fmt: skip
    try:
        list(trainer.steps(num_epochs=1, max_steps=5))
        pids = trainer.process_ids
    finally:
        trainer.close()
    assert procs.survivors(pids) == []
    rows = _rows(tmp_path)
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:  # every worker's fingerprint was the trainer's (a mismatch stops the run)
        assert row["publish/verified_workers"] == 2, row
    by_version = {int(r["weight_version"]): r for r in rows}
    # v1: nothing before it to diff; v3: an anchor (anchor_every 3); v2, v4, v5: deltas every worker took
    assert [by_version[v]["publish/delta_workers"] for v in (1, 2, 3, 4, 5)] == [0, 2, 0, 2, 2]
    assert by_version[1]["publish/delta_mb"] == by_version[3]["publish/delta_mb"] == 0
    for v in (2, 4, 5):
        assert by_version[v]["publish/delta_mb"] > 0
        if dtype == "bfloat16":  # at this learning rate few bf16 weights change: the delta is a fraction
            assert by_version[v]["publish/delta_mb"] < 0.5 * by_version[v]["publish/mb"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sync_broken_on_purpose_is_refused_by_name(
    tmp_path: Path, tiny_model_dir: Path, procs: Any
) -> None:
    trainer = _trainer(tiny_model_dir, tmp_path)
    try:
        list(trainer.steps(num_epochs=1, max_steps=1))
        fleet = trainer.fleet
        published = fleet.published
        assert published is not None and published.fingerprint and len(published.buckets) > 2
        lost = published.model_copy(update={"buckets": published.buckets[1:]})  # a bucket lost on the way
        refusal = r"rollout worker rollout-\d loaded weight version 1 with fingerprint xxh3_128p:\w+, but"
        with pytest.raises(WeightSyncMismatch, match=refusal + r" the trainer published xxh3_128p:\w+"):
            trainer.run(fleet.load_weights(lost))
        again = trainer.run(fleet.load_weights(published))  # the whole version: verified again
        assert {r.fingerprint for r in again} == {published.fingerprint}
        zeros = "0" * 32
        fleet._check_loaded(again[0].model_copy(update={"fingerprint": f"xxh3_128:{zeros}"}))  # another
        # scheme (a release that hashed in one stream): nothing to compare, not refused; this one's is
        with pytest.raises(WeightSyncMismatch):
            fleet._check_loaded(again[0].model_copy(update={"fingerprint": f"xxh3_128p:{zeros}"}))
        pids = trainer.process_ids
    finally:
        trainer.close()
    assert procs.survivors(pids) == []
