"""LoRA through real processes (issue 32, points 1 and 2): the tiny GRPO job with ``model.lora`` (a
private nats-server, a trainer, a reward worker and a rollout worker on the HF engine or the vLLM CPU
build; library use) raises its reward; every publish is the adapter alone (``weight_sync.adapter``,
the default: 0.13 MB here against 0.34 MB merged; or the weights merged), which the engine then
serves on its base (its fingerprint is the trainer's, and its logprobs are the trainer's policy's);
the reference is the base with the adapters off (a KL term is measured, no second model loaded); the
export holds the adapter in PEFT's format beside the merged model. On this character model LoRA
learns far slower than full training (its tied embeddings, which full training moves first, stay
frozen): the test asks for a small rise.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from rlfleet.controller import GRPOTrainer, TrainerConfig

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
RANK, STEPS = 16, 16


@pytest.mark.timeout(420)
@pytest.mark.parametrize(  # the HF engine with the adapter is the suite's LoRA run; the others are slow
    ("engine", "adapter"),
    [
        ("hf", True),
        pytest.param("vllm", True, marks=pytest.mark.slow),
        pytest.param("hf", False, marks=pytest.mark.slow),
    ],
)
def test_lora_training_raises_the_reward(
    tmp_path: Path, tiny_model_dir: Path, procs: Any, engine: str, adapter: bool
) -> None:
    if engine == "vllm":
        pytest.importorskip("vllm")
    config = TrainerConfig(
        rollout_batch_size=16, train_batch_size=16, group_size=8, micro_batch_size=128,
        max_response_length=12, max_prompt_length=32, learning_rate=5e-2, kl_coef=0.01, temperature=1.0,
        output_dir=str(tmp_path),
        loggers=["jsonl"], sample_table_size=0, seed=0, rollout={"engine": engine},
        model={"lora": {"rank": RANK, "alpha": 2.0 * RANK}}, weight_sync={"adapter": adapter},
    )  # fmt: skip
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789", str(DATA), config)
    try:
        list(trainer.steps(num_epochs=2, max_steps=STEPS))
        trainer.finish()
        pids = trainer.process_ids
    finally:
        trainer.close()
    assert procs.survivors(pids) == []
    rows = [
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    rewards = [row["reward/mean"] for row in rows]
    # adapters on the attention and MLP layers of this 2-block character model lift the share of
    # digits from about 0.10 to 0.13-0.15 in 16 steps and no further: its tied embeddings, small at
    # init and frozen under LoRA, bound how far a normalised hidden state can tilt the logits (full
    # training, which grows them, reaches 0.9 in 20 steps)
    assert statistics.fmean(rewards[-8:]) > statistics.fmean(rewards[:3]) + 0.015, f"no rise: {rewards}"
    assert all(row["publish/verified_workers"] == 1 for row in rows)  # the engine holds what was published
    assert all(row["publish/adapter"] == adapter for row in rows)  # the adapter alone (weight_sync.adapter)
    assert all(row["publish/mb"] < 0.2 if adapter else row["publish/mb"] > 0.3 for row in rows)  # or merged
    # ... and the engine serves the base plus it: its logprobs are the trainer's (the policy's, drifted
    # from the base by the KL below; an engine left on the base would be off by about that much)
    assert all(row["rollout_logprob_diff"] < 1e-3 for row in rows) and rows[-1]["kl"] > 0.01
    assert all(row["kl"] >= 0 for row in rows) and rows[-1]["kl"] > 0  # against the base, adapters off
    assert (tmp_path / "final" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "final" / "config.json").is_file()
