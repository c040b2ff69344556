"""Fixtures of the trainer tests: a tiny tied-embedding Llama saved to disk, and rollout batches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (hidden 32, vocab 64, tied lm_head) from save_pretrained, plus a tokenizer file."""
    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return path


def _make_batch(
    prompt_lens: list[int], response_lens: list[int], *, seed: int = 0, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """A contract batch: prompts left-padded to the longest, responses right-padded to the longest."""
    gen = torch.Generator().manual_seed(seed)
    n, p, r = len(prompt_lens), max(prompt_lens), max(response_lens)
    batch = {
        "prompt_ids": torch.full((n, p), pad_id, dtype=torch.int64),
        "prompt_mask": torch.zeros((n, p), dtype=torch.int64),
        "response_ids": torch.full((n, r), pad_id, dtype=torch.int64),
        "response_mask": torch.zeros((n, r), dtype=torch.int64),
    }
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        batch["prompt_ids"][i, p - pl :] = torch.randint(3, VOCAB, (pl,), generator=gen)
        batch["prompt_mask"][i, p - pl :] = 1
        batch["response_ids"][i, :rl] = torch.randint(3, VOCAB, (rl,), generator=gen)
        batch["response_mask"][i, :rl] = 1
    batch["group_index"] = torch.arange(n) // 2
    return batch


MakeBatch = Callable[..., dict[str, torch.Tensor]]


@pytest.fixture
def make_batch() -> MakeBatch:
    """``make_batch(prompt_lens, response_lens, *, seed=0)`` -> a contract batch (see ``_make_batch``)."""
    return _make_batch
