"""The vLLM engine's GPU memory share, sized from the model and the batch it serves.

vLLM takes ``gpu_memory_utilization`` x the card's memory for itself (weights, activations, CUDA
graphs, and a KV cache that fills whatever of the share is left). A fixed share is wrong both
ways: 0.85 of an H200 (about 120 GB) for a 135M-parameter model starves a colocated trainer, and
0.3 is too little for an 8B model's KV cache. With ``gpu_memory_utilization: auto`` (the default)
the engine asks for what its work needs:

- weights: every parameter of the checkpoint (the safetensors headers) at the engine's dtype,
  divided over ``tensor_parallel_size`` ranks;
- KV cache: ``max_num_seqs`` sequences of ``max_model_len`` tokens at once (no sequence is ever
  preempted for want of blocks), 2 x layers x KV heads x head size x dtype bytes a token;
- activations and graphs: the profile forward over ``max(max_num_batched_tokens, max_num_seqs)``
  tokens (a hidden-sized residual, the attention and MLP intermediates), the sampler's float32
  logits for ``max_num_seqs`` rows, plus a fixed allowance for the CUDA context, cuBLAS workspaces
  and CUDA graph pools (:data:`FIXED_OVERHEAD_BYTES`);

times a margin (:data:`MARGIN`) and as a share of the card's total memory, within
[:data:`MIN_SHARE`, :data:`MAX_SHARE`]. A job whose need passes :data:`MAX_SHARE` gets that share
and a warning: vLLM then schedules fewer sequences at once than ``max_num_seqs``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlfleet.common.errors import ConfigError

logger = logging.getLogger(__name__)

GIB = 2**30
FIXED_OVERHEAD_BYTES = int(1.5 * GIB)
"""CUDA context, cuBLAS/NCCL workspaces and CUDA graph pools of one engine rank (measured on an
H200 with vLLM 0.26: 0.6 to 1.2 GiB of non-torch memory for models up to 0.5B)."""
MARGIN = 1.15
"""Head room over the estimate (allocator fragmentation, vLLM's block rounding)."""
MIN_SHARE, MAX_SHARE = 0.03, 0.9
DEFAULT_BATCHED_TOKENS = 8192
"""vLLM's chunked-prefill token budget a step (``max_num_batched_tokens``) when not set."""
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the budget needs of a decoder's config (its text config for multimodal ones)."""

    layers: int
    hidden: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """Read from an HF ``PretrainedConfig`` (Llama, Qwen2, Mistral, SmolLM and kin)."""
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
        return cls(layers=int(config.num_hidden_layers), hidden=hidden, intermediate=int(intermediate),
                   kv_heads=int(kv_heads), head_dim=int(head_dim), vocab=int(config.vocab_size))  # fmt: skip


@dataclass(frozen=True)
class MemoryBudget:
    """One engine rank's estimated need, in bytes, and the share of the card it asks for."""

    weights: int
    kv_cache: int
    activations: int
    total_memory: int

    @property
    def need(self) -> int:
        return int((self.weights + self.kv_cache + self.activations) * MARGIN)

    @property
    def share(self) -> float:
        """``need`` as a fraction of the card, rounded up to 0.01, within [MIN_SHARE, MAX_SHARE]."""
        raw = self.need / self.total_memory
        return min(MAX_SHARE, max(MIN_SHARE, -(-raw * 100 // 1) / 100))

    def describe(self) -> str:
        gb = 1e9
        return (
            f"{self.share:.2f} of {self.total_memory / gb:.1f} GB (weights {self.weights / gb:.2f} GB, "
            f"KV cache {self.kv_cache / gb:.2f} GB, activations and graphs {self.activations / gb:.2f} GB, "
            f"x{MARGIN} margin)"
        )


def estimate(
    shape: ModelShape,
    parameters: int,
    *,
    dtype: str,
    max_num_seqs: int,
    max_model_len: int,
    total_memory: int,
    tensor_parallel_size: int = 1,
    max_num_batched_tokens: int | None = None,
) -> MemoryBudget:
    """The need of one engine rank serving ``max_num_seqs`` sequences of up to ``max_model_len`` tokens.

    Raises:
        ConfigError: a size is not positive, or the dtype is unknown.
    """
    for name, value in (("parameters", parameters), ("max_num_seqs", max_num_seqs),
                        ("max_model_len", max_model_len), ("total_memory", total_memory),
                        ("tensor_parallel_size", tensor_parallel_size)):  # fmt: skip
        if value < 1:
            raise ConfigError(name, value, "must be positive to size the engine's memory")
    if dtype not in DTYPE_BYTES:
        raise ConfigError("dtype", dtype, f"expected one of {', '.join(DTYPE_BYTES)}")
    size, tp = DTYPE_BYTES[dtype], tensor_parallel_size
    weights = parameters * size // tp
    kv_heads = max(1, shape.kv_heads // tp)
    kv = 2 * shape.layers * kv_heads * shape.head_dim * size * max_num_seqs * max_model_len
    tokens = max(max_num_batched_tokens or DEFAULT_BATCHED_TOKENS, max_num_seqs)
    per_token = (4 * shape.hidden + 2 * shape.intermediate // tp) * size
    logits = max_num_seqs * shape.vocab * 4 * 2  # float32 logits and their softmax in the sampler
    activations = tokens * per_token + logits + FIXED_OVERHEAD_BYTES
    return MemoryBudget(weights=weights, kv_cache=kv, activations=activations, total_memory=total_memory)


def checkpoint_parameters(weights: Mapping[str, torch.Tensor]) -> int:
    """Parameters the engine holds: every stored tensor (a tied LM head is stored, and held, once)."""
    return sum(t.numel() for t in weights.values()) or 1


def engine_memory_fraction(
    config: Any,
    weights: Mapping[str, torch.Tensor],
    *,
    dtype: str,
    max_num_seqs: int,
    max_model_len: int,
    tensor_parallel_size: int = 1,
    total_memory: int | None = None,
) -> MemoryBudget:
    """The budget for a checkpoint (its HF config and safetensors weight specs) on this process's
    first visible CUDA device (``total_memory`` read through vLLM's platform, by NVML, when not
    given: initializing CUDA here would force vLLM to start its engine core by spawn)."""
    if total_memory is None:
        from vllm.platforms import current_platform

        total_memory = int(current_platform.get_device_total_memory(0))
    budget = estimate(ModelShape.of(config), checkpoint_parameters(weights), dtype=dtype,
                      max_num_seqs=max_num_seqs, max_model_len=max_model_len, total_memory=total_memory,
                      tensor_parallel_size=tensor_parallel_size)  # fmt: skip
    if budget.need / total_memory > MAX_SHARE:
        logger.warning(
            "the engine's estimated need (%.1f GB for %d sequences of %d tokens) passes %.0f%% of the "
            "card; it takes that share and vLLM runs fewer sequences at once (lower max_batch_size "
            "or rollout.engine.max_model_len to fit)",
            budget.need / 1e9, max_num_seqs, max_model_len, MAX_SHARE * 100,
        )  # fmt: skip
    return budget
