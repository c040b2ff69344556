"""DPO steps on a tiny Llama: the preference-batch contract, the first loss, micro-batching, learning."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlfleet.common.messages import TrainStepRequest
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.config import ActorConfig, OptimizerConfig, UpdateConfig
from rlfleet.trainer.dpo_update import (
    DPOSettings,
    dpo_update,
    merge_preference_batches,
    pair_batch,
    reference_logps,
    validate_pairs,
)
from rlfleet.trainer.errors import InvalidBatch
from rlfleet.trainer.inputs import build_policy_inputs
from rlfleet.trainer.service import TrainerServiceConfig
from rlfleet.trainer.updates import merge_batch, run_update

pytestmark = pytest.mark.timeout(180)

VOCAB = 64


def _pairs(n: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """N pairs: prompts of 2..4 tokens, chosen responses of tokens 3..32, rejected of 33..63."""
    gen = torch.Generator().manual_seed(seed)
    out = {key: torch.zeros((n, 5), dtype=torch.int64) for key in ("prompt_ids", "prompt_mask")}
    for key in ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"):
        out[key] = torch.zeros((n, 4), dtype=torch.int64)
    for i in range(n):
        p, c, r = 2 + i % 3, 1 + i % 4, 4 - i % 3
        out["prompt_ids"][i, 5 - p :] = torch.randint(3, VOCAB, (p,), generator=gen)
        out["prompt_mask"][i, 5 - p :] = 1
        out["chosen_ids"][i, :c] = torch.randint(3, 33, (c,), generator=gen)
        out["chosen_mask"][i, :c] = 1
        out["rejected_ids"][i, :r] = torch.randint(33, VOCAB, (r,), generator=gen)
        out["rejected_mask"][i, :r] = 1
    return out


def _actor(path: Path, lr: float = 1e-3) -> Actor:
    return Actor(ActorConfig(model_path=str(path), optim=OptimizerConfig(lr=lr, weight_decay=0.0)))


def test_pairs_become_2n_sequences_chosen_first() -> None:
    batch = _pairs(3)
    rows = pair_batch(batch)
    assert rows["prompt_ids"].shape == (6, 5) and rows["response_ids"].shape == (6, 4)
    torch.testing.assert_close(rows["response_ids"][:3], batch["chosen_ids"])
    torch.testing.assert_close(rows["response_ids"][3:], batch["rejected_ids"])
    torch.testing.assert_close(rows["prompt_ids"][3:], batch["prompt_ids"])


def test_the_contract_is_checked() -> None:
    assert validate_pairs(_pairs(2)) == 2
    missing = {k: v for k, v in _pairs(2).items() if k != "rejected_mask"}
    with pytest.raises(InvalidBatch, match="rejected_mask"):
        validate_pairs(missing)
    empty = _pairs(2)
    empty["chosen_mask"][1] = 0
    with pytest.raises(InvalidBatch, match="empty response"):
        validate_pairs(empty)
    bad_ref = {**_pairs(2), "ref_chosen_logps": torch.zeros(3)}
    with pytest.raises(InvalidBatch, match="ref_chosen_logps"):
        validate_pairs(bad_ref)


def test_merging_chunks_repads_prompts_left_and_responses_right() -> None:
    a, b = _pairs(2), _pairs(1, seed=1)
    b = {
        k: v[:, 1:] if k.startswith("prompt") else torch.cat([v, torch.zeros_like(v[:, :2])], 1)
        for k, v in b.items()
    }
    merged = merge_batch("dpo", [a, b])
    assert merged["prompt_ids"].shape == (3, 5) and merged["chosen_ids"].shape == (3, 6)
    torch.testing.assert_close(merged["prompt_ids"][2, 1:], b["prompt_ids"][0])
    assert merge_preference_batches([a])["chosen_ids"] is a["chosen_ids"]


def test_the_first_step_starts_at_log_2_and_micro_batches_add_up(tiny_model_dir: Path) -> None:
    batch, dpo = _pairs(6), DPOSettings(beta=0.5)
    actors = [_actor(tiny_model_dir), _actor(tiny_model_dir)]
    whole = dpo_update(actors[0], batch, dpo, UpdateConfig(micro_batch_size=6))
    parts = dpo_update(actors[1], batch, dpo, UpdateConfig(micro_batch_size=4))
    assert whole["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert whole["dpo/accuracy"] == 0.0 and whole["dpo/margin"] == pytest.approx(0.0, abs=1e-6)
    for key in ("loss", "grad_norm", "response_length"):
        assert parts[key] == pytest.approx(whole[key], rel=1e-5), key
    for p, q in zip(actors[0].model.parameters(), actors[1].model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_precomputed_reference_logps_are_used_as_given(tiny_model_dir: Path) -> None:
    actor = _actor(tiny_model_dir)
    batch = _pairs(4)
    inputs = build_policy_inputs(pair_batch(batch))
    ref = reference_logps(actor, batch, inputs, micro_pairs=2)
    given = {**batch, "ref_chosen_logps": ref[:4] - 1.0, "ref_rejected_logps": ref[4:]}
    metrics = dpo_update(actor, given, DPOSettings(beta=1.0), UpdateConfig(micro_batch_size=4))
    # the policy is the reference, so each pair's chosen reward is beta * (pi_c - (ref_c - 1)) = 1
    assert metrics["dpo/chosen_reward"] == pytest.approx(1.0, rel=1e-5)
    assert metrics["dpo/accuracy"] == 1.0


def test_dpo_accuracy_and_margin_rise_over_steps(tiny_model_dir: Path) -> None:
    cfg = TrainerServiceConfig(model_path=str(tiny_model_dir), algorithm="dpo", micro_batch_size=4,
                               learning_rate=3e-3, algo={"beta": 0.5})  # fmt: skip
    actor = _actor(tiny_model_dir, lr=3e-3)
    batch = _pairs(8)
    history = []
    for step in range(1, 7):
        request = TrainStepRequest(
            step=step, rollouts=[], scores=[], algorithm="dpo", hyperparams={"num_updates": 2}
        )
        history.append(run_update(actor, None, cfg, batch, request))
    margins = [m["dpo/margin"] for m in history]
    assert history[-1]["dpo/accuracy"] == 1.0 and history[0]["dpo/accuracy"] < 1.0
    assert margins == sorted(margins) and margins[-1] > 0.5, margins
    assert history[-1]["loss"] < history[0]["loss"] and history[0]["num_optimizer_steps"] == 2
    assert {"dpo/chosen_reward", "dpo/rejected_reward", "grad_norm", "lr"} <= history[-1].keys()
