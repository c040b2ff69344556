"""The rollout tier's engine settings: the job's ``rollout:`` section and each rollout worker's config.

A rollout worker's config is :class:`~rlfleet.common.schema.worker.ModelWorkerConfig` plus these;
the controller's ``rollout`` section is these plus its sampling options, and a named pool
overrides any of them for its workers. Sampling (temperature, top-p, top-k, lengths) travels with
every generate request instead (``SamplingParams``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlfleet.common.schema.config import ConfigModel
from rlfleet.common.schema.worker import ModelWorkerConfig

Engine = Literal["hf", "vllm", "auto"]
EngineDtype = Literal["float32", "bfloat16", "float16"]


class RolloutSettings(ConfigModel):
    """How a rollout worker's engine runs; fixed for the worker's life."""

    engine: Engine = Field(
        default="hf", description="generation engine; auto = vLLM when importable, else HF transformers"
    )
    dtype: EngineDtype = Field(default="float32", description="engine dtype")
    max_batch_size: int = Field(default=64, ge=1, description="sequences one worker generates together")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM: GPUs one engine shards over")
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] | Literal["auto"] = Field(
        default="auto",
        description="vLLM: the card's memory share the engine takes; auto = sized from the model, "
        "max_batch_size and max_cache_len (weights + a KV cache for every sequence at full length + "
        "activations and graphs, with a margin)",
    )
    enforce_eager: bool | None = Field(
        default=None, description="vLLM: skip torch.compile and CUDA graphs; None = eager on CPU only"
    )
    colocate: bool = Field(
        default=False, description="vLLM sleeps between rollouts to share the GPU with training (not on CPU)"
    )
    sleep_level: Literal[1, 2] = Field(
        default=1, description="vLLM sleep when colocated: 1 offloads weights to CPU, 2 discards them"
    )
    cache_policy: Literal["lru", "none"] = Field(
        default="lru", description="vLLM KV cache: lru = prefix caching with LRU eviction, none = off"
    )
    max_cache_len: int = Field(
        default=2048, ge=2, description="vLLM: longest context (prompt + response) a request may use"
    )


class RolloutWorkerConfig(ModelWorkerConfig, RolloutSettings):
    """A rollout worker's config (``rlfleet-rollout serve --config``)."""

    capacity: int = Field(default=1, ge=1, description="generate jobs taken at once")
    results_store_mb: float = Field(default=4096, gt=0, description="TensorStore capacity for results (MiB)")
    store_ttl_s: float = Field(default=1800, gt=0, description="results not fetched by then are dropped")
    catch_up_timeout_s: float = Field(
        default=10.0, gt=0, description="late join: wait this long for the trainer's latest weights"
    )
