"""The vLLM engine's memory share with ``gpu_memory_utilization: auto``: sized from the model and batch."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.rollout import RolloutSettings, VLLMEngineSettings
from rlfleet.rollout.engines.vllm.memory_budget import (
    FIXED_OVERHEAD_BYTES,
    MARGIN,
    MAX_SHARE,
    MIN_SHARE,
    ModelShape,
    engine_memory_fraction,
    estimate,
)

GB = 10**9
H200 = 143_771 * 2**20
SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152)  # fmt: skip
QWEN_05B = ModelShape(layers=24, hidden=896, intermediate=4864, kv_heads=2, head_dim=64, vocab=151936)


def test_kv_cache_weights_and_activations_by_hand() -> None:
    shape = ModelShape(layers=2, hidden=8, intermediate=16, kv_heads=2, head_dim=4, vocab=10)
    b = estimate(shape, 1000, dtype="bfloat16", max_num_seqs=3, max_model_len=5, total_memory=GB,
                 max_num_batched_tokens=7)  # fmt: skip
    assert b.weights == 1000 * 2
    assert (
        b.kv_cache == 2 * 2 * 2 * 4 * 2 * 3 * 5
    )  # k and v, layers, kv heads, head size, bytes, seqs, tokens
    assert b.activations == 7 * (4 * 8 + 2 * 16) * 2 + 3 * 10 * 4 * 2 + FIXED_OVERHEAD_BYTES
    assert b.need == int((b.weights + b.kv_cache + b.activations) * MARGIN)


def test_the_share_grows_with_the_batch_and_the_context() -> None:
    small = estimate(
        QWEN_05B, 494_000_000, dtype="bfloat16", max_num_seqs=64, max_model_len=512, total_memory=H200
    )
    seqs = estimate(
        QWEN_05B, 494_000_000, dtype="bfloat16", max_num_seqs=1024, max_model_len=512, total_memory=H200
    )
    longer = estimate(
        QWEN_05B, 494_000_000, dtype="bfloat16", max_num_seqs=64, max_model_len=8192, total_memory=H200
    )
    assert small.share < seqs.share and small.share < longer.share
    # a 0.5B model with 64 sequences of 512 tokens needs a few GB, not a third of an H200
    assert small.share <= 0.04 and small.need < 5 * GB


def test_tensor_parallel_ranks_split_weights_and_kv_heads() -> None:
    one = estimate(
        QWEN_05B, 494_000_000, dtype="bfloat16", max_num_seqs=64, max_model_len=2048, total_memory=H200
    )
    two = estimate(QWEN_05B, 494_000_000, dtype="bfloat16", max_num_seqs=64, max_model_len=2048,
                   total_memory=H200, tensor_parallel_size=2)  # fmt: skip
    assert two.weights == one.weights // 2 and two.kv_cache == one.kv_cache // 2


def test_share_is_clamped_and_rounded_up() -> None:
    tiny = estimate(QWEN_05B, 1000, dtype="bfloat16", max_num_seqs=1, max_model_len=8, total_memory=10**15)
    assert tiny.share == MIN_SHARE
    huge = estimate(
        QWEN_05B, 70 * 10**9, dtype="bfloat16", max_num_seqs=256, max_model_len=32768, total_memory=H200
    )
    assert huge.share == MAX_SHARE
    mid = estimate(
        QWEN_05B, 494_000_000, dtype="float32", max_num_seqs=256, max_model_len=2048, total_memory=H200
    )
    assert mid.share * mid.total_memory >= mid.need  # rounded up, never below the need
    assert round(mid.share, 2) == mid.share


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"max_num_seqs": 0}, "max_num_seqs"), ({"max_model_len": 0}, "max_model_len"),
     ({"total_memory": 0}, "total_memory"), ({"dtype": "float8"}, "dtype")],
)  # fmt: skip
def test_bad_sizes_are_named(kwargs: dict, field: str) -> None:
    args = {"dtype": "bfloat16", "max_num_seqs": 4, "max_model_len": 16, "total_memory": GB, **kwargs}
    with pytest.raises(ConfigError, match=field):
        estimate(QWEN_05B, 1000, **args)


def test_from_a_checkpoints_config_and_weight_specs(caplog: pytest.LogCaptureFixture) -> None:
    weights = {"model.embed_tokens.weight": torch.empty(49152, 576, device="meta"),
               "model.layers.0.mlp.up_proj.weight": torch.empty(1536, 576, device="meta")}  # fmt: skip
    budget = engine_memory_fraction(SMOLLM2, weights, dtype="bfloat16", max_num_seqs=64, max_model_len=2048,
                                    total_memory=H200)  # fmt: skip
    assert budget.weights == (49152 * 576 + 1536 * 576) * 2
    assert budget.kv_cache == 2 * 30 * 3 * 64 * 2 * 64 * 2048  # head size 576 / 9 = 64
    assert "KV cache" in budget.describe() and f"{budget.share:.2f}" in budget.describe()
    with caplog.at_level("WARNING"):
        engine_memory_fraction(SMOLLM2, weights, dtype="float32", max_num_seqs=4096, max_model_len=8192,
                               total_memory=H200)  # fmt: skip
    assert "fewer sequences" in caplog.text


def test_the_setting_takes_auto_or_a_share() -> None:
    assert VLLMEngineSettings(type="vllm").gpu_memory_utilization == "auto"
    assert RolloutSettings(engine="vllm").vllm().gpu_memory_utilization == "auto"
    assert VLLMEngineSettings(type="vllm", gpu_memory_utilization=0.4).gpu_memory_utilization == 0.4
    for bad in (0.0, 1.5, "most"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            VLLMEngineSettings(type="vllm", gpu_memory_utilization=bad)
