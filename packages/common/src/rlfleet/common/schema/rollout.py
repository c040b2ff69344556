"""The rollout tier's engine settings: the job's ``rollout:`` section and each rollout worker's config.

A rollout worker's config is :class:`~rlfleet.common.schema.worker.ModelWorkerConfig` plus these
(its ``rollout`` section); the controller's ``rollout`` section is these plus its sampling options
and pools, and a named pool overrides any of them for its workers. Sampling (temperature, top-p,
top-k, lengths) travels with every generate request instead (``SamplingParams``).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from rlfleet.common.schema.config import ConfigModel, Legacy
from rlfleet.common.schema.worker import ModelLoading, ModelWorkerConfig

logger = logging.getLogger(__name__)

EngineName = Literal["hf", "vllm", "auto"]
EngineDtype = Literal["float32", "bfloat16", "float16"]
VLLM_ONLY = ("tensor_parallel_size", "gpu_memory_utilization", "enforce_eager", "colocate", "sleep_level",
             "enable_prefix_caching", "max_model_len")  # fmt: skip
"""The settings only the vLLM engine has (a previous release's flat form may give them to HF)."""


def _prefix_caching(policy: Any) -> Any:
    return {"lru": True, "none": False}.get(policy, policy)


def _cache_policy(enabled: Any) -> Any:
    return {True: "lru", False: "none"}.get(enabled, enabled)


class HFEngineSettings(ConfigModel):
    """``engine: {type: hf}``: HF transformers' ``generate`` with the KV cache (any device)."""

    SHORT_FORM: ClassVar[str | None] = "type"

    type: Literal["hf"] = Field(description="hf")


class VLLMEngineSettings(ConfigModel):
    """``engine: {type: vllm, ...}`` (``auto``: vLLM when it is importable, else the HF engine): the
    offline ``vllm.LLM``; each setting is the engine's keyword of the same name."""

    SHORT_FORM: ClassVar[str | None] = "type"

    type: Literal["vllm", "auto"] = Field(description="vllm, or auto (vLLM when importable, else HF)")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one engine shards over")
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] | Literal["auto"] = Field(
        default="auto",
        description="the card's memory share the engine takes; auto = sized from the model, "
        "max_batch_size and max_model_len (weights + a KV cache for every sequence at full length + "
        "activations and graphs, with a margin)",
    )
    enforce_eager: bool | None = Field(
        default=None, description="skip torch.compile and CUDA graphs; None = eager on CPU only"
    )
    colocate: bool = Field(
        default=False, description="sleep between rollouts to share the GPU with training (not on CPU)"
    )
    sleep_level: Literal[0, 1, 2] = Field(
        default=1,
        description="sleep when colocated: 1 offloads weights to CPU, 2 discards them, 0 stays awake "
        "(the engine keeps its share while the trainer steps: for jobs where both fit on the card)",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="reuse the KV blocks of shared prompt prefixes (LRU eviction)"
    )
    max_model_len: int = Field(
        default=2048, ge=2, description="longest context (prompt + response) a request may use"
    )
    max_lora_rank: int = Field(
        default=0, ge=0, le=512,
        description="serve LoRA adapters up to this rank (vLLM's enable_lora); 0: none. A run with "
        "model.lora and weight_sync.adapter raises it to the adapter's rank",
    )  # fmt: skip


EngineSettings = Annotated[HFEngineSettings | VLLMEngineSettings, Field(discriminator="type")]


class RolloutSettings(ConfigModel):
    """How a rollout worker's engine runs; fixed for the worker's life. ``engine`` is a tagged union
    (``engine: vllm`` is short for ``engine: {type: vllm}``); the previous release's flat form
    (``engine: vllm`` beside ``colocate``, ``cache_policy``, ``max_cache_len``) loads too."""

    FLAT_SECTIONS: ClassVar[frozenset[str]] = frozenset({"engine"})
    DEFAULT_TAGS: ClassVar[dict[str, str]] = {"engine": "hf"}
    RENAMED: ClassVar[tuple[Legacy, ...]] = (
        Legacy("cache_policy", ("engine", "enable_prefix_caching"), _prefix_caching, _cache_policy),
        Legacy("max_cache_len", ("engine", "max_model_len")),
        Legacy("engine", ("engine", "type")),
    )

    engine: EngineSettings = Field(
        default_factory=lambda: HFEngineSettings(type="hf"),
        description="generation engine: {type: hf} | {type: vllm | auto, <vLLM settings>}",
    )
    dtype: EngineDtype = Field(default="float32", description="engine dtype")
    max_batch_size: int = Field(default=64, ge=1, description="sequences one worker generates together")
    partial_rollout_tokens: int = Field(
        default=0, ge=0, le=1 << 16,
        description="partial rollouts: generate in segments of this many new tokens, letting a weight "
        "load in between (the rest of a sample goes on under the new weights, each token recording its "
        "version); 0 = off, a load waits for the whole generation",
    )  # fmt: skip

    @classmethod
    def tidy(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The previous release let vLLM-only settings sit beside ``engine: hf`` (unused); they go."""
        if isinstance(data.get("engine"), dict):
            engine = dict(data["engine"])
            if engine.get("type") == "hf":
                dropped = [k for k in VLLM_ONLY if engine.pop(k, None) is not None]
                if dropped:
                    logger.warning("rollout: the HF engine has no %s; ignored", ", ".join(dropped))
            data = {**data, "engine": engine}
        return data

    def vllm(self) -> VLLMEngineSettings | None:
        """The vLLM settings when the engine may be vLLM (``vllm`` or ``auto``); None for HF."""
        return self.engine if isinstance(self.engine, VLLMEngineSettings) else None

    @property
    def context_cap(self) -> int | None:
        """The longest prompt + response a request may use (vLLM's ``max_model_len``); None: no cap."""
        engine = self.vllm()
        return engine.max_model_len if engine is not None else None


class GenerateLimits(ConfigModel):
    """What one generate request may ask of this worker in all: the products of its fields, each
    field being bounded already where it arrives (``SamplingParams``). A request over a limit is
    refused before any work (``bad_request`` naming the product, its value and the limit); so is
    a prompt that with ``max_tokens`` does not fit the served model's context. The defaults let a
    large GRPO step through in one chunk and refuse what would hold the worker for hours."""

    max_samples: int = Field(default=32768, ge=1, description="samples in one request: prompts x n")
    max_new_tokens: int = Field(
        default=1 << 25, ge=1, description="tokens one request may generate: prompts x n x max_tokens"
    )
    max_prompt_tokens: int = Field(
        default=1 << 25, ge=1, description="prompt tokens over all samples: the prompts' total length x n"
    )
    deadline_slack_s: float = Field(
        default=5.0, ge=0.0, allow_inf_nan=False,
        description="a request's deadline is cut this many seconds late: the requester's clock may be "
        "behind this worker's by that much",
    )  # fmt: skip


class RolloutWorkerConfig(ModelWorkerConfig):
    """A rollout worker's config (``rlfleet-rollout serve --config``): its engine settings
    (``rollout``, the job's section as it is) and its own."""

    FLAT_SECTIONS: ClassVar[frozenset[str]] = ModelWorkerConfig.FLAT_SECTIONS | {"loading", "rollout"}

    loading: ModelLoading = Field(default_factory=ModelLoading, description="what loading the model may run")
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description="its engine")
    capacity: int = Field(default=1, ge=1, description="generate jobs taken at once")
    results_store_mb: float = Field(default=4096, gt=0, description="TensorStore capacity for results (MiB)")
    store_ttl_s: float = Field(default=1800, gt=0, description="results not fetched by then are dropped")
    catch_up_timeout_s: float = Field(
        default=10.0, gt=0, description="late join: wait this long for the trainer's latest weights"
    )
    limits: GenerateLimits = Field(
        default_factory=GenerateLimits, description="what one generate request may ask in all; its deadline"
    )
    env_url: str | None = Field(
        default=None,
        description="NATS URL of the reward servers that serve the episodes' environments (a shared "
        "server); None: the fleet's own. Its login comes from RLFLEET_REWARD_NATS_*, the tenant token "
        "from RLFLEET_REWARD_TOKEN",
    )
    env_cluster: str = Field(
        default="", description="cluster name of env_url's reward servers; empty: 'default' with env_url"
    )
