"""Typed settings of the actor: model loading, optimizer, and the policy loss of one update."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlfleet.trainer.algorithms.aggregation import LossAgg
from rlfleet.trainer.distributed import Sharding

logger = logging.getLogger(__name__)


class OptimizerConfig(BaseModel):
    """AdamW and its learning-rate schedule (linear warmup, then constant)."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=1e-6, gt=0.0, description="peak learning rate")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas")
    eps: float = Field(default=1e-8, gt=0.0, description="AdamW epsilon")
    weight_decay: float = Field(default=0.01, ge=0.0, description="decoupled weight decay")
    warmup_steps: int = Field(default=0, ge=0, description="optimizer steps of linear warmup from 0 to lr")


class ActorConfig(BaseModel):
    """How to build an :class:`~rlfleet.trainer.actor.Actor`."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(description="local directory written by save_pretrained")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="parameter dtype of the policy and the reference"
    )
    device: str = Field(
        default="cpu", description="torch device of the policy and the reference (one rank; ranks use theirs)"
    )
    attn_implementation: str | None = Field(
        default=None, description="HF attention kernel ('sdpa', 'eager', ...); None lets HF choose"
    )
    temperature: float = Field(
        default=1.0, gt=0.0, description="the rollout sampling temperature; logits are divided by it"
    )
    seed: int | None = Field(
        default=0, description="torch seed at construction and for shuffling; None: leave it unseeded"
    )
    use_reference: bool = Field(
        default=False,
        description="load the frozen reference at construction (it is loaded on demand when kl_coef > 0)",
    )
    gradient_checkpointing: bool = Field(default=False, description="recompute activations in backward")
    trainable_layers: int | None = Field(
        default=None,
        ge=1,
        description="train only the top N transformer blocks (+ final norm); embeddings frozen. None: all",
    )
    mixed_precision: Literal["none", "bf16"] = Field(
        default="none",
        description="bf16 autocast for forward/backward with float32 master weights and optimizer state "
        "(about 1.8x faster matmuls on CPUs with AVX512-BF16/AMX, and the usual choice on GPU)",
    )
    sharding: Sharding = Field(
        default="auto",
        description="with several ranks: full (FSDP over all ranks), hybrid (shard in a node, replicate "
        "across nodes), none (replicate), auto (full on one node, hybrid on several); ignored with one rank",
    )
    reshard_after_forward: bool = Field(
        default=True,
        description="FSDP frees each block's gathered weights after its forward (ZeRO-3); False keeps "
        "them for backward (more memory, one all-gather less per block and micro-batch)",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile the decoder blocks and the logprob reduction (faster on GPU; the "
        "first steps compile, and each new sequence shape may compile again)",
    )
    logprob_chunk_rows: int = Field(
        default=1024, ge=1, description="tokens per chunk of the logprob reduction"
    )
    optim: OptimizerConfig = Field(default_factory=OptimizerConfig, description="optimizer settings")


class PolicyLossConfig(BaseModel):
    """The loss of one policy update: ``pg_loss - entropy_coef * entropy + kl_coef * kl_loss``."""

    model_config = ConfigDict(extra="forbid")

    clip_eps: float = Field(default=0.2, gt=0.0, description="PPO lower clip range (and upper, by default)")
    clip_eps_high: float | None = Field(
        default=None, gt=0.0, description="upper clip range (DAPO clip-higher)"
    )
    clip_ratio_c: float | None = Field(default=None, gt=1.0, description="dual-clip constant; None disables")
    kl_coef: float = Field(default=0.0, ge=0.0, description="weight of the KL-to-reference loss term")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(default="k3", description="per-token KL estimator")
    entropy_coef: float = Field(default=0.0, ge=0.0, description="weight of the entropy bonus")
    loss_agg: LossAgg = Field(default="token-mean", description="how per-token terms reduce to a scalar")


class UpdateConfig(BaseModel):
    """How one call to ``Actor.update`` splits the batch into optimizer steps."""

    model_config = ConfigDict(extra="forbid")

    micro_batch_size: int = Field(ge=1, description="samples per forward/backward (gradient accumulation)")
    mini_batch_size: int | None = Field(
        default=None, ge=1, description="samples per optimizer step; None: the whole batch (one step)"
    )
    ppo_epochs: int = Field(default=1, ge=1, description="passes over the batch")
    max_grad_norm: float | None = Field(default=1.0, gt=0.0, description="gradient clipping; None disables")
    shuffle: bool = Field(default=True, description="shuffle rows between mini-batches (seeded)")

    @model_validator(mode="after")
    def _micro_fits_mini(self) -> UpdateConfig:
        if self.mini_batch_size is not None and self.micro_batch_size > self.mini_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) is larger than mini_batch_size "
                f"({self.mini_batch_size}); lower micro_batch_size or raise mini_batch_size"
            )
        return self
