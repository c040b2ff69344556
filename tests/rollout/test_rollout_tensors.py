"""to_rollout_tensors: the rollout-batch tensor contract (padding sides, masks, logprobs, texts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfleet.common.control.messages import SamplingParams
from rlfleet.common.schema.batch import unpack_texts
from rlfleet.rollout.engines import Completion, HFEngine
from rlfleet.rollout.service import to_rollout_tensors

PAD = 0


def _completions() -> list[Completion]:
    return [
        Completion(0, 0, [5, 6, 7], [8, 1], [-0.5, -0.25], "hé", "stop"),
        Completion(0, 1, [5, 6, 7], [9, 10, 11], [-1.0, -2.0, -3.0], "abc", "length"),
        Completion(1, 0, [4], [12], [-0.125], "", "length"),
        Completion(1, 1, [4], [13, 14, 1], [], "日本", "stop"),
    ]


@pytest.mark.timeout(30)
def test_contract_shapes_padding_and_masks() -> None:
    batch = to_rollout_tensors(_completions(), PAD)
    assert batch["prompt_ids"].tolist() == [[5, 6, 7], [5, 6, 7], [PAD, PAD, 4], [PAD, PAD, 4]]
    assert batch["prompt_mask"].tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert batch["response_ids"].tolist() == [[8, 1, PAD], [9, 10, 11], [12, PAD, PAD], [13, 14, 1]]
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    assert batch["rollout_logprobs"].tolist() == [
        [-0.5, -0.25, 0.0],
        [-1.0, -2.0, -3.0],
        [-0.125, 0.0, 0.0],
        [0.0, 0.0, 0.0],  # no logprobs recorded: zeros
    ]
    assert batch["group_index"].tolist() == [0, 0, 1, 1]
    dtypes = {k: v.dtype for k, v in batch.items()}
    assert dtypes == {
        "prompt_ids": torch.int64,
        "prompt_mask": torch.int64,
        "response_ids": torch.int64,
        "response_mask": torch.int64,
        "rollout_logprobs": torch.float32,
        "group_index": torch.int64,
        "prompt_text": torch.uint8,
        "prompt_text_offsets": torch.int64,
        "response_text": torch.uint8,
        "response_text_offsets": torch.int64,
    }


@pytest.mark.timeout(30)
def test_texts_are_utf8_with_offsets() -> None:
    batch = to_rollout_tensors(_completions(), PAD)
    assert batch["response_text_offsets"].tolist() == [0, 3, 6, 6, 12]  # "hé" is 3 bytes, "日本" 6
    assert unpack_texts(batch["response_text"], batch["response_text_offsets"]) == ["hé", "abc", "", "日本"]
    assert batch["prompt_text"].numel() == 0  # no tokenizer: empty prompt texts
    assert batch["prompt_text_offsets"].tolist() == [0, 0, 0, 0, 0]


@pytest.mark.timeout(30)
def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        to_rollout_tensors([], PAD)
    broken = Completion(2, 1, [4], [5, 6], [-1.0], "", "length")
    with pytest.raises(ValueError, match="prompt 2, sample 1.*2 tokens but 1 logprobs"):
        to_rollout_tensors([broken], PAD)


@pytest.mark.timeout(60)
def test_engine_output_packs_consistently(tiny_checkpoint: Path) -> None:
    engine = HFEngine(tiny_checkpoint)
    prompts = [engine.tokenizer(t)["input_ids"] for t in ("hi there", "ok")]
    out = engine.generate(prompts, SamplingParams(n=3, max_tokens=6, seed=2))
    batch = to_rollout_tensors(out, engine.pad_token_id, engine.tokenizer)
    n = len(out)
    assert batch["prompt_ids"].shape == (n, 8) and batch["response_ids"].shape[0] == n
    assert batch["group_index"].tolist() == [0, 0, 0, 1, 1, 1]
    assert unpack_texts(batch["prompt_text"], batch["prompt_text_offsets"]) == ["hi there"] * 3 + ["ok"] * 3
    assert unpack_texts(batch["response_text"], batch["response_text_offsets"]) == [c.text for c in out]
    lengths = batch["response_mask"].sum(dim=1).tolist()
    assert lengths == [len(c.token_ids) for c in out]
    for row, c in enumerate(out):
        assert batch["response_ids"][row, : len(c.token_ids)].tolist() == c.token_ids
        assert batch["rollout_logprobs"][row, : len(c.token_ids)].tolist() == pytest.approx(c.logprobs)
        assert not batch["rollout_logprobs"][row, len(c.token_ids) :].any()
