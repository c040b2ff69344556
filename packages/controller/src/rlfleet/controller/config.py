"""Typed configuration of a training run: :class:`TrainerConfig` and the CLI's :class:`JobConfig`.

``TrainerConfig`` is what a library user passes to ``GRPOTrainer(config=...)``. A job file for
``rlfleet train`` is a ``TrainerConfig`` plus what the library user passes as arguments (model,
reward, data, epochs), so every field is reachable from the command line as ``a.b=value``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from rlfleet.common.carriers import CarrierSetting
from rlfleet.controller.algo_config import OFFLINE_ALGORITHMS, AlgorithmFields, check_algorithm_fields


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RolloutConfig(_Config):
    """How the rollout tier generates."""

    engine: Literal["hf", "vllm", "auto"] = Field(
        default="hf", description="generation engine; auto = vLLM when importable, else HF transformers"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="engine dtype")
    max_batch_size: int = Field(default=64, ge=1, description="sequences generated together by one worker")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling")
    top_k: int = Field(default=-1, description="top-k sampling; -1 disables")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM: GPUs one engine shards over")
    gpu_memory_utilization: float = Field(default=0.85, gt=0.0, le=1.0, description="vLLM: GPU memory share")
    enforce_eager: bool | None = Field(
        default=None, description="vLLM: skip torch.compile and CUDA graphs; None = eager on CPU only"
    )
    colocate: bool = Field(
        default=False, description="vLLM sleeps between rollouts to share the GPU with training (not on CPU)"
    )
    sleep_level: Literal[1, 2] = Field(
        default=1, description="vLLM sleep when colocated: 1 offloads weights to CPU, 2 discards them"
    )


POOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
RESERVED_ROUTES = ("any", "text")
"""Route names of :meth:`~rlfleet.controller.grpo.GRPOTrainer.set_rollout_fn` that no pool may take:
``any`` (every pool serves) and ``text`` (the rollout fn wrote the response itself)."""


class RolloutPoolConfig(_Config):
    """One named rollout pool: its size, and where it differs from ``rollout`` (None: the same)."""

    workers: int = Field(default=1, ge=1, description="rollout worker processes in this pool")
    engine: Literal["hf", "vllm", "auto"] | None = Field(default=None, description="engine of this pool")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(default=None, description="engine dtype")
    max_batch_size: int | None = Field(
        default=None, ge=1, description="sequences one worker generates together"
    )
    tensor_parallel_size: int | None = Field(
        default=None, ge=1, description="vLLM: GPUs one engine shards over"
    )
    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0, description="vLLM: GPU share")


class TrainerConfig(AlgorithmFields):
    """Hyperparameters and run settings shared by the GRPO/PPO/DPO trainers.

    The algorithm's own fields (``algorithm``, the KL controller, PPO's GAE and critic, DPO's
    ``beta``) come from :class:`~rlfleet.controller.algo_config.AlgorithmFields`.
    """

    rollout_batch_size: int = Field(default=16, ge=1, description="prompts per step")
    train_batch_size: int = Field(
        default=16, ge=1, description="prompts per optimizer update; rollout_batch_size must be a multiple"
    )
    micro_batch_size: int = Field(default=8, ge=1, description="sequences per forward/backward pass")
    group_size: int = Field(default=4, ge=1, description="samples per prompt (grpo and rloo need >= 2)")
    num_rollout_workers: int = Field(default=1, ge=1, description="rollout worker processes")
    num_train_workers: int = Field(
        default=1, ge=1, description="trainer ranks (processes, one GPU each) sharing the model by FSDP2"
    )
    sharding: Literal["auto", "full", "hybrid", "none"] = Field(
        default="auto",
        description="how the trainer ranks share the model: full (FSDP), hybrid (shard within a node, "
        "replicate across nodes), none (replicate), auto (full on one node, hybrid on several)",
    )
    ppo_epochs: int = Field(default=1, ge=1, description="passes over each rollout batch")
    kl_coef: float = Field(
        default=0.05, ge=0.0, description="KL-to-reference coefficient (the KL controller's start value)"
    )
    clip_eps: float = Field(default=0.2, gt=0.0, description="PPO ratio clip range")
    entropy_coef: float = Field(default=0.0, description="entropy bonus weight")
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        default="token-mean", description="how per-token losses are averaged"
    )
    max_grad_norm: float = Field(default=1.0, gt=0.0, description="gradient clipping norm")
    learning_rate: float = Field(default=1e-6, gt=0.0, description="AdamW learning rate")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay")
    max_prompt_length: int = Field(default=512, ge=1, description="longest prompt in tokens")
    max_response_length: int = Field(default=128, ge=1, description="longest response in tokens")
    temperature: float = Field(default=1.0, gt=0.0, description="sampling temperature")
    seed: int = Field(default=42, description="seed for data order, sampling and init")
    output_dir: str = Field(default="outputs/run", description="metrics, logs and checkpoints go here")
    log_every: int = Field(default=1, ge=1, description="steps between [PROGRESS] lines")
    save_every: int = Field(
        default=0, ge=0,
        description="steps between full checkpoints (output_dir/checkpoint-<step>); 0: final HF model only",
    )  # fmt: skip
    resume_from: str | None = Field(
        default=None,
        description="continue a run from a checkpoint-<step> directory, or 'auto': the latest one in "
        "output_dir (a fresh start when there is none)",
    )
    loggers: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["console", "jsonl", "tensorboard"], description="metric sinks"
    )
    weight_bucket_mb: float = Field(default=64.0, gt=0.0, description="weight publish bucket size")
    weight_carrier: CarrierSetting = Field(
        default="auto",
        description="how published weights reach rollout workers: auto = CUDA IPC for a worker on the "
        "trainer's GPU (colocated), gRPC for the others; grpc = always the tensor plane; "
        "cuda_ipc = demand IPC",
    )
    reward_endpoint: str = Field(default="default", description="reward endpoint that scores rollouts")
    reward_url: str | None = Field(
        default=None,
        description="NATS URL of a shared reward server (rlfleet-reward serve); None: the run's own reward "
        "worker. The server fetches rollout texts from the rollout workers' stores: they must be reachable",
    )
    reward_cluster: str = Field(
        default="", description="cluster name of the shared reward server; empty: 'default' with reward_url"
    )
    reward_token: SecretStr = Field(
        default=SecretStr(""), description="tenant token for the reward server; empty: $RLFLEET_REWARD_TOKEN"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="where the trainer runs")
    trainable_layers: int | None = Field(
        default=None,
        ge=1,
        description="train only the top N transformer blocks (+ final norm), embeddings frozen; "
        "cheap on CPU. None trains every parameter",
    )
    mixed_precision: Literal["auto", "none", "bf16"] = Field(
        default="auto",
        description="trainer bf16 autocast with fp32 master weights; auto: bf16 on GPU, none (fp32) on CPU. "
        "bf16 is also much faster on CPUs with AVX512-BF16 or AMX",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="rollout tier settings")
    rollout_pools: dict[str, RolloutPoolConfig] = Field(
        default_factory=dict,
        description="named rollout pools (e.g. {small: {workers: 1, engine: hf}, fleet: {workers: 2}}) that "
        "a rollout fn routes prompts to (set_rollout_fn); empty: one pool 'default' of num_rollout_workers",
    )
    rollout_cache_policy: Literal["lru", "none"] = Field(
        default="lru", description="vLLM KV cache: lru = prefix caching with LRU eviction, none = off"
    )
    rollout_max_cache_len: int = Field(
        default=2048, ge=2, description="vLLM: longest context (prompt + response) a request may use"
    )
    nats_url: str | None = Field(
        default=None, description="join a running fleet at this NATS URL; None starts an embedded one"
    )
    cluster: str = Field(default="", description="cluster name; empty: a fresh name per run")
    startup_timeout_s: float = Field(default=180.0, gt=0, description="wait for workers to announce")
    request_timeout_s: float = Field(
        default=900.0, gt=0, description="longest a single tier request may take"
    )
    sample_table_size: int = Field(default=4, ge=0, description="prompts shown in the before/after table")

    @model_validator(mode="after")
    def _check_batches(self) -> TrainerConfig:
        if self.rollout_batch_size % self.train_batch_size:
            raise ValueError(
                f"rollout_batch_size ({self.rollout_batch_size}) must be a multiple of train_batch_size "
                f"({self.train_batch_size}); set train_batch_size to a divisor of it"
            )
        if self.max_prompt_length + self.max_response_length > self.rollout_max_cache_len:
            raise ValueError(
                f"max_prompt_length ({self.max_prompt_length}) + max_response_length "
                f"({self.max_response_length}) exceeds rollout_max_cache_len ({self.rollout_max_cache_len}); "
                "raise rollout_max_cache_len or shorten prompts/responses (longer requests are refused)"
            )
        return self

    @model_validator(mode="after")
    def _check_pools(self) -> TrainerConfig:
        for name in self.rollout_pools:
            if not POOL_NAME.match(name):
                raise ValueError(f"rollout pool name {name!r}: use 1-64 letters, digits, '_' or '-'")
            if name in RESERVED_ROUTES:
                raise ValueError(
                    f"rollout pool name {name!r} is reserved (routes {RESERVED_ROUTES} are built in)"
                )
        total = sum(pool.workers for pool in self.rollout_pools.values())
        if total and "num_rollout_workers" in self.model_fields_set and self.num_rollout_workers != total:
            raise ValueError(
                f"num_rollout_workers ({self.num_rollout_workers}) differs from the workers of rollout_pools "
                f"({total}); set one of them"
            )
        return self

    def pool_sizes(self) -> dict[str, int]:
        """Rollout workers per pool, in config order (no pools: ``{'default': num_rollout_workers}``)."""
        if not self.rollout_pools:
            return {"default": self.num_rollout_workers}
        return {name: pool.workers for name, pool in self.rollout_pools.items()}

    def publish_dtype(self) -> str:
        """The dtype weights are published in: the engines' when every pool runs one reduced dtype
        (they would cast to it on load anyway: half the bytes to move), else the trainer's own ("")."""
        dtypes = {self.rollout.dtype}
        for pool in (self.rollout_pools or {}).values():
            dtypes.add(pool.dtype or self.rollout.dtype)
        only = dtypes.pop() if len(dtypes) == 1 else ""
        return only if only in ("bfloat16", "float16") else ""

    @model_validator(mode="after")
    def _check_algorithm(self) -> TrainerConfig:
        check_algorithm_fields(self.algorithm, self.group_size, self.kl_coef, self)
        return self


class DataConfig(_Config):
    """Where prompts come from."""

    path: str = Field(description="JSONL, CSV or Parquet file of prompts")
    prompt_key: str = Field(default="prompt", description="column holding the prompt (text or chat messages)")
    chosen_key: str = Field(default="chosen", description="DPO: column holding the preferred response")
    rejected_key: str = Field(default="rejected", description="DPO: column holding the dispreferred response")
    max_prompt_length: int | None = Field(default=None, description="overrides the trainer's when set")
    overlong: Literal["filter", "truncate", "error"] = Field(default="filter", description="overlong prompts")
    system_prompt: str | None = Field(default=None, description="system message for chat templates")
    num_workers: int = Field(default=1, ge=1, description="tokenizer threads")


class JobConfig(TrainerConfig):
    """A whole run for ``rlfleet train``: the trainer's settings plus model, reward and data."""

    model: str = Field(description="actor model: a local HF dir, 'smollm2', or 'tiny:<name>'")
    reward: str | dict[str, Any] | None = Field(
        default=None, description="reward spec for the reward tier (e.g. 'rm:path=/m'); dpo takes none"
    )
    data: DataConfig = Field(description="prompt dataset")
    num_epochs: int = Field(default=1, ge=1, description="passes over the dataset")
    max_steps: int | None = Field(default=None, ge=1, description="stop after this many steps")
    description: str = Field(default="", description="free text shown at start")
    rollout_fn: str | None = Field(
        default=None,
        description="'package.module:function' routing each prompt to a rollout pool or answering it "
        "(GRPOTrainer.set_rollout_fn); the module must be importable from where rlfleet runs",
    )

    @model_validator(mode="after")
    def _online_needs_reward(self) -> JobConfig:
        if self.reward is None and self.algorithm not in OFFLINE_ALGORITHMS:
            raise ValueError(f"algorithm {self.algorithm} scores rollouts: set reward (a reward spec)")
        if self.rollout_fn and self.algorithm in OFFLINE_ALGORITHMS:
            raise ValueError(f"rollout_fn routes rollouts; algorithm {self.algorithm} generates none")
        return self

    def trainer_config(self) -> TrainerConfig:
        """The TrainerConfig part of this job."""
        fields = [name for name in TrainerConfig.model_fields if name in self.model_fields_set]
        return TrainerConfig(**{name: getattr(self, name) for name in fields})
