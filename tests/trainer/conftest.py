"""Fixtures of the trainer tests: a tiny tied-embedding Llama saved to disk, and rollout batches."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from batches import VOCAB, contract_batch  # noqa: E402  (this folder's helper module)


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


MakeBatch = Callable[..., dict[str, torch.Tensor]]


@pytest.fixture
def make_batch() -> MakeBatch:
    """``make_batch(prompt_lens, response_lens, *, seed=0)`` -> a contract batch (``batches.py``)."""
    return contract_batch
