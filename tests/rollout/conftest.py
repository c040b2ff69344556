"""Fixtures for rollout tests: a char-level tokenizer and tiny Llama checkpoints built on the fly.

This folder is on ``sys.path``: ``weight_buckets.py`` cuts a model's weights as a trainer publishes them.
"""

from __future__ import annotations

import string
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.tensors.server import TensorStoreServer
from rlfleet.rollout.service import RolloutWorker

sys.path.insert(0, str(Path(__file__).parent))  # this folder's helper modules (weight_buckets.py)
from real_worker import running_worker  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = list(string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,!?")
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2

TokenizerBuilder = Callable[..., PreTrainedTokenizerFast]
CheckpointBuilder = Callable[..., Path]


def _build_char_tokenizer(with_pad: bool = True) -> PreTrainedTokenizerFast:
    """One token per character (WordLevel over single chars), 4 specials first: vocab size 71."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    extra = {"pad_token": "<pad>"} if with_pad else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", bos_token="<bos>", unk_token="<unk>", **extra
    )


SHAPES: dict[str, dict[str, int]] = {
    # hidden 32, 4 query heads, 2 KV heads: the HF engine's tests
    "hf": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
    # 2 query heads of dim 32 (vLLM's CPU attention needs >= 32), 1 KV head
    "vllm": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
}


def _build_tiny_model(seed: int, vocab_size: int, tie: bool = True, shape: str = "hf") -> LlamaForCausalLM:
    """A 2-layer Llama of ``SHAPES[shape]`` with a wide init, so its next-token distributions are not flat."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        num_hidden_layers=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        initializer_range=0.2,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **SHAPES[shape],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def char_tokenizer() -> TokenizerBuilder:
    """Builder: ``char_tokenizer(with_pad=True)`` -> a fresh PreTrainedTokenizerFast."""
    return _build_char_tokenizer


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointBuilder:
    """Builder: ``make_checkpoint(seed=0, tie=True, with_pad=True)`` -> dir with a tiny model + tokenizer."""
    made: dict[tuple[int, bool, bool], Path] = {}

    def build(seed: int = 0, tie: bool = True, with_pad: bool = True) -> Path:
        key = (seed, tie, with_pad)
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-llama-s{seed}-tie{int(tie)}-pad{int(with_pad)}")
            tokenizer = _build_char_tokenizer(with_pad)
            _build_tiny_model(seed, len(tokenizer), tie).save_pretrained(path)
            tokenizer.save_pretrained(path)
            made[key] = path
        return made[key]

    return build


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint: CheckpointBuilder) -> Path:
    """The default tiny checkpoint (seed 0, tied embeddings, tokenizer with a pad token)."""
    return make_checkpoint()


@pytest.fixture(scope="session")
def make_vllm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointBuilder:
    """Builder: ``make_vllm_checkpoint(seed=0, tie=True)`` -> dir with a tiny model vLLM can serve on CPU."""
    made: dict[tuple[int, bool], Path] = {}

    def build(seed: int = 0, tie: bool = True) -> Path:
        if (seed, tie) not in made:
            path = tmp_path_factory.mktemp(f"vllm-llama-s{seed}-tie{int(tie)}")
            tokenizer = _build_char_tokenizer(True)
            _build_tiny_model(seed, len(tokenizer), tie, "vllm").save_pretrained(path)
            tokenizer.save_pretrained(path)
            made[(seed, tie)] = path
        return made[(seed, tie)]

    return build


# --- a real rollout worker on a real nats-server, and a trainer's TensorStore -------------------------


@pytest.fixture
async def nats() -> AsyncIterator[EmbeddedNats]:
    with EmbeddedNats(jetstream=False) as server:
        yield server


@pytest.fixture
async def worker(nats: EmbeddedNats, make_checkpoint) -> AsyncIterator[RolloutWorker]:  # noqa: ANN001
    async with running_worker(nats.url, make_checkpoint(seed=0)) as started:
        yield started


@pytest.fixture
async def store() -> AsyncIterator[TensorStoreServer]:
    """The trainer's side: a real TensorStore the worker pulls buckets from over gRPC."""
    server = TensorStoreServer(capacity_bytes=1 << 28, ttl_s=600)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def control(nats: EmbeddedNats) -> AsyncIterator[NatsTransport]:
    transport = await NatsTransport.connect(nats.url, name="controller", tier="controller")
    try:
        yield transport
    finally:
        await transport.close()
