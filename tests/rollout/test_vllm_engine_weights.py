"""VLLMEngine.load_weights on CPU: trainer-style buckets, parity with HF, tied embeddings, validation.

Runs where vLLM is installed (``uv run --extra cpu pytest``); skipped otherwise. One engine for the
module (prefix caching on, so a stale cache after a load would show up as wrong tokens); every
test first loads the weights it starts from.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from weight_buckets import weight_buckets  # (this folder's helper module)

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines import HFEngine
from rlfleet.rollout.errors import IncompleteWeights, UnknownWeight, WeightShapeMismatch

pytest.importorskip("vllm", reason="vLLM is not installed (uv sync --extra cpu)")

from rlfleet.rollout.engines.vllm import VLLMEngine  # noqa: E402

LONG = [5 + (i * 7) % 60 for i in range(140)]  # > one 128-token KV block: served from the prefix cache
PROMPTS = [[30, 11, 8, 15], [5, 40, 6], LONG]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path).eval()


def _publish(engine: VLLMEngine, model: torch.nn.Module, version: int, bucket_bytes: int = 20_000) -> int:
    """Load ``model`` the way a trainer publishes: small buckets (cut inside blocks), then the version."""
    buckets = list(weight_buckets(model, bucket_bytes))
    for bucket in buckets:
        engine.load_weights(bucket)
    engine.set_weight_version(version)
    return len(buckets)


def _assert_same(ours: list, theirs: list) -> None:
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def engine(make_vllm_checkpoint) -> Iterator[VLLMEngine]:
    vllm_engine = VLLMEngine(make_vllm_checkpoint(seed=0, tie=True), enforce_eager=True, max_model_len=160)
    yield vllm_engine
    vllm_engine.close()


@pytest.mark.timeout(180)
def test_trainer_buckets_give_hf_parity_of_the_new_weights(engine: VLLMEngine, make_vllm_checkpoint) -> None:
    _publish(engine, _model(make_vllm_checkpoint(seed=0)), version=0)
    before = engine.generate(PROMPTS, GREEDY)
    engine.generate(PROMPTS, GREEDY)
    assert engine.cached_prompt_tokens >= 128  # the long prompt's first block is cached now
    target = make_vllm_checkpoint(seed=1)
    assert _publish(engine, _model(target), version=7) > 4
    assert engine.weight_version == 7
    after = engine.generate(PROMPTS, GREEDY)
    expected = HFEngine(target).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in before] != [c.token_ids for c in expected]
    _assert_same(after, expected)  # the long prompt too: its cached blocks were dropped with the old weights


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sent_as", [EMBED, HEAD])
def test_tied_head_follows_the_embedding(engine: VLLMEngine, make_vllm_checkpoint, sent_as: str) -> None:
    base = make_vllm_checkpoint(seed=0)
    _publish(engine, _model(base), version=0)
    new_embedding = _model(make_vllm_checkpoint(seed=2)).state_dict()[EMBED]
    engine.load_weights({sent_as: new_embedding}, version=1)
    reference = HFEngine(base)
    reference.load_weights({EMBED: new_embedding})  # the HF model is tied: its head changes too
    assert torch.equal(reference.model.lm_head.weight, new_embedding)
    _assert_same(engine.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY))


@pytest.mark.timeout(120)
def test_a_partly_sent_block_is_never_loaded(engine: VLLMEngine, make_vllm_checkpoint) -> None:
    _publish(engine, _model(make_vllm_checkpoint(seed=0)), version=2)
    before = engine.generate(PROMPTS, GREEDY)
    other = _model(make_vllm_checkpoint(seed=1)).state_dict()
    engine.load_weights(
        {"model.layers.0.self_attn.q_proj.weight": other["model.layers.0.self_attn.q_proj.weight"]}
    )
    with pytest.raises(IncompleteWeights, match="8 tensor") as caught:
        engine.set_weight_version(3)
    assert "model.layers.0.self_attn.k_proj.weight" in caught.value.missing
    assert engine.weight_version == 2
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == [c.token_ids for c in before]
    engine.set_weight_version(3)  # the partial block was dropped: nothing is pending any more
    assert engine.weight_version == 3


@pytest.mark.timeout(120)
def test_bad_buckets_are_refused_before_anything_loads(engine: VLLMEngine, make_vllm_checkpoint) -> None:
    _publish(engine, _model(make_vllm_checkpoint(seed=0)), version=0)
    before = engine.generate(PROMPTS, GREEDY)
    norm = torch.full((64,), 3.0)
    with pytest.raises(UnknownWeight, match="did you mean 'model.norm.weight'"):
        engine.load_weights({"model.norm.weight": norm, "model.nrom.weight": norm})
    with pytest.raises(WeightShapeMismatch, match=r"\[65\] does not match the model's \[64\]"):
        engine.load_weights(
            {"model.norm.weight": norm, "model.layers.1.input_layernorm.weight": torch.ones(65)}
        )
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == [c.token_ids for c in before]


@pytest.mark.timeout(120)
def test_a_single_tensor_block_loads_at_once(engine: VLLMEngine, make_vllm_checkpoint) -> None:
    base = make_vllm_checkpoint(seed=0)
    _publish(engine, _model(base), version=0)
    norm = torch.linspace(0.5, 1.5, 64)
    engine.load_weights({"model.norm.weight": norm}, version=5)
    reference = HFEngine(base)
    reference.load_weights({"model.norm.weight": norm})
    assert engine.weight_version == 5
    _assert_same(engine.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY))


def test_cuda_ipc_loads_are_refused_on_cpu_before_anything_loads(engine: VLLMEngine) -> None:
    from rlfleet.common.schema.carriers import IpcBucket
    from rlfleet.rollout.errors import IpcUnavailable

    tensors = [{"name": EMBED, "dtype": "float32", "shape": [1], "offset": 0}]
    bucket = IpcBucket(
        gpu_uuid="2703ff26-bf43", handle="QUFB", storage_bytes=256, storage_offset=0, tensors=tensors
    )
    with pytest.raises(IpcUnavailable, match="one CUDA device"):
        engine.load_ipc([bucket])
    assert engine.gpu_uuids == []
