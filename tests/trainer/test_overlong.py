"""Overlong shaping (issue 31, point 3): DAPO's soft length penalty and the filter of truncated
samples, on a hand-made batch whose cap is 6 tokens (EOS id 2)."""

from __future__ import annotations

import pytest
import torch

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.trainer import UpdateSettings
from rlfleet.trainer.algorithms.overlong import length_penalty, shape, truncated
from rlfleet.trainer.policy import build_policy_inputs

EOS = torch.tensor([2])
# lengths 3 (stopped), 5 (stopped), 6 (cut: its last token is not EOS), 6 (stopped exactly at the cap)
RESPONSES = [[5, 6, 2, 0, 0, 0], [5, 6, 7, 8, 2, 0], [5, 6, 7, 8, 9, 9], [5, 6, 7, 8, 9, 2]]


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.tensor(RESPONSES)
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in (3, 5, 6, 6)])
    prompts = torch.full((4, 2), 4)
    return {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts), "response_ids": ids,
            "response_mask": mask, "group_index": torch.tensor([0, 0, 1, 1])}  # fmt: skip


def test_a_sample_is_cut_when_it_reaches_the_cap_without_a_stop_token() -> None:
    batch = _batch()
    assert truncated(batch["response_ids"], batch["response_mask"], 6, EOS).tolist() == [
        False,
        False,
        True,
        False,
    ]


def test_the_soft_penalty_falls_linearly_over_the_buffer() -> None:
    # cap 6, buffer 4: 0 up to 2 tokens, then -0.5 * (|y| - 2) / 4, -0.5 at the cap
    assert length_penalty(torch.tensor([1, 2, 3, 5, 6]), 6, 4, 0.5).tolist() == [
        0.0,
        0.0,
        -0.125,
        -0.375,
        -0.5,
    ]


def test_shape_adds_the_penalty_and_masks_the_cut_sample_out_of_the_loss_only() -> None:
    update = UpdateSettings(overlong_buffer=4, overlong_penalty=0.5, mask_truncated=True, response_cap=6)
    batch, scores, metrics = shape(_batch(), torch.tensor([1.0, 1.0, 1.0, 0.0]), update, EOS)
    assert scores.tolist() == [0.875, 0.625, 0.5, -0.5]  # lengths 3, 5, 6, 6
    assert metrics == {
        "overlong/truncated_frac": 0.25,
        "overlong/penalty_mean": -0.375,  # (-0.125 - 0.375 - 0.5 - 0.5) / 4
        "overlong/masked_frac": 0.25,
    }
    inputs = build_policy_inputs(batch)
    assert inputs.response_mask.sum(dim=-1).tolist() == [3, 5, 0, 6]  # the losses skip the cut sample
    assert inputs.attention_mask[2].sum() == 8  # which the model still reads whole
    assert batch["response_mask"][2].sum() == 6  # and its tokens still count elsewhere (the contract)


def test_each_half_alone_and_the_cap_it_needs() -> None:
    only_penalty = UpdateSettings(overlong_buffer=2, response_cap=6)
    batch, scores, metrics = shape(_batch(), torch.zeros(4), only_penalty, EOS)
    assert "loss_mask" not in batch and "overlong/masked_frac" not in metrics
    assert scores.tolist() == [0.0, -0.5, -1.0, -1.0]
    only_filter = UpdateSettings(mask_truncated=True, response_cap=6)
    batch, scores, metrics = shape(_batch(), torch.zeros(4), only_filter, EOS)
    assert scores.tolist() == [0.0] * 4 and "overlong/penalty_mean" not in metrics
    with pytest.raises(ConfigError, match="response_cap"):
        shape(_batch(), torch.zeros(4), UpdateSettings(mask_truncated=True), EOS)
    with pytest.raises(ConfigError, match="overlong_buffer"):
        shape(_batch(), torch.zeros(4), UpdateSettings(overlong_buffer=7, response_cap=6), EOS)
