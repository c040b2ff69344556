"""DPO steps on a tiny Llama: the preference-batch contract as the trainer uses it, the first loss,
micro-batching, learning."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlfleet.common.errors import BatchContractError
from rlfleet.common.schema.batch import check_pairs, merge_preferences, pairs_as_rollouts
from rlfleet.common.schema.trainer import AlgorithmSettings, BatchSettings, StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.dpo import DPO, reference_logps
from rlfleet.trainer.loop import train_loop
from rlfleet.trainer.policy import build_policy_inputs
from rlfleet.trainer.service import merge_batch, run_step

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
    return Actor(path, learning_rate=lr, weight_decay=0.0)


def _dpo(
    actor: Actor, batch: dict[str, torch.Tensor], *, beta: float, micro_batch_size: int
) -> dict[str, float]:
    """One DPO step's plan through the update loop (no learning-rate change: the actor's own)."""
    step = StepSettings(algorithm=AlgorithmSettings(name="dpo", beta=beta),
                        update=UpdateSettings(micro_batch_size=micro_batch_size))  # fmt: skip
    return train_loop(DPO().plan(actor, None, batch, torch.zeros(0), step))


def test_pairs_become_2n_sequences_chosen_first() -> None:
    batch = _pairs(3)
    rows = pairs_as_rollouts(batch)
    assert rows["prompt_ids"].shape == (6, 5) and rows["response_ids"].shape == (6, 4)
    torch.testing.assert_close(rows["response_ids"][:3], batch["chosen_ids"])
    torch.testing.assert_close(rows["response_ids"][3:], batch["rejected_ids"])
    torch.testing.assert_close(rows["prompt_ids"][3:], batch["prompt_ids"])


def test_the_contract_is_checked() -> None:
    assert check_pairs(_pairs(2)) == 2
    missing = {k: v for k, v in _pairs(2).items() if k != "rejected_mask"}
    with pytest.raises(BatchContractError, match="rejected_mask"):
        merge_batch("dpo", [missing])  # what a trainer step does with the fetched chunks
    empty = _pairs(2)
    empty["chosen_mask"][1] = 0
    with pytest.raises(BatchContractError, match="empty response"):
        check_pairs(empty)
    bad_ref = {**_pairs(2), "ref_chosen_logps": torch.zeros(3)}
    with pytest.raises(BatchContractError, match="ref_chosen_logps"):
        check_pairs(bad_ref)


def test_merging_chunks_repads_prompts_left_and_responses_right() -> None:
    a, b = _pairs(2), _pairs(1, seed=1)
    b = {
        k: v[:, 1:] if k.startswith("prompt") else torch.cat([v, torch.zeros_like(v[:, :2])], 1)
        for k, v in b.items()
    }
    merged = merge_batch("dpo", [a, b])
    assert merged["prompt_ids"].shape == (3, 5) and merged["chosen_ids"].shape == (3, 6)
    torch.testing.assert_close(merged["prompt_ids"][2, 1:], b["prompt_ids"][0])
    assert merge_preferences([a])["chosen_ids"] is a["chosen_ids"]


def test_the_first_step_starts_at_log_2_and_micro_batches_add_up(tiny_model_dir: Path) -> None:
    batch = _pairs(6)
    actors = [_actor(tiny_model_dir), _actor(tiny_model_dir)]
    whole = _dpo(actors[0], batch, beta=0.5, micro_batch_size=6)
    parts = _dpo(actors[1], batch, beta=0.5, micro_batch_size=4)
    assert whole["loss"] == pytest.approx(math.log(2), rel=1e-6)
    # policy == reference: every implicit reward is 0 up to float rounding (the policy's forward shares
    # each pair's prompt and the reference's runs the rows in another order, so not bit for bit);
    # the accuracy compares two such zeros, so it is not checked here
    for key in ("dpo/chosen_reward", "dpo/rejected_reward", "dpo/margin"):
        assert whole[key] == pytest.approx(0.0, abs=1e-6), key
    for key in ("loss", "grad_norm", "response_length"):
        assert parts[key] == pytest.approx(whole[key], rel=1e-5), key
    for p, q in zip(actors[0].model.parameters(), actors[1].model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_precomputed_reference_logps_are_used_as_given(tiny_model_dir: Path) -> None:
    actor = _actor(tiny_model_dir)
    batch = _pairs(4)
    inputs = build_policy_inputs(pairs_as_rollouts(batch))
    ref = reference_logps(actor, batch, inputs, micro_pairs=2)
    given = {**batch, "ref_chosen_logps": ref[:4] - 1.0, "ref_rejected_logps": ref[4:]}
    metrics = _dpo(actor, given, beta=1.0, micro_batch_size=4)
    # the policy is the reference, so each pair's chosen reward is beta * (pi_c - (ref_c - 1)) = 1
    assert metrics["dpo/chosen_reward"] == pytest.approx(1.0, rel=1e-5)
    assert metrics["dpo/accuracy"] == 1.0


def test_dpo_accuracy_and_margin_rise_over_steps(tiny_model_dir: Path) -> None:
    settings = StepSettings(algorithm=AlgorithmSettings(name="dpo", beta=0.5),
                            update=UpdateSettings(micro_batch_size=4, learning_rate=3e-3),
                            batch=BatchSettings(rollout_batch_size=2, train_batch_size=1))  # fmt: skip
    actor = _actor(tiny_model_dir)  # the step's settings give it its learning rate
    batch = _pairs(8)
    history = [run_step(actor, None, batch, [], settings) for _ in range(6)]
    margins = [m["dpo/margin"] for m in history]
    assert history[-1]["dpo/accuracy"] == 1.0 and history[0]["dpo/accuracy"] < 1.0
    assert margins == sorted(margins) and margins[-1] > 0.5, margins
    assert history[-1]["loss"] < history[0]["loss"] and history[0]["num_optimizer_steps"] == 2
    assert {"dpo/chosen_reward", "dpo/rejected_reward", "grad_norm", "lr"} <= history[-1].keys()
    assert history[0]["lr"] == pytest.approx(3e-3)
