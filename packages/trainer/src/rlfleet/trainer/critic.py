"""PPO's critic: a value model (an HF transformer backbone plus a linear value head) and its updates.

The value of response token t is read from the hidden state of the position *before* it (the
state in which token t was chosen), exactly as the logits that give its logprob::

    input_ids  (B, P + R) ──backbone──> hidden (B, P + R, H) ──[:, -(R+1):-1]──> (B, R, H)
                                                              ──value_head──> values (B, R)

The backbone is ``AutoModel`` loaded from a causal-LM checkpoint (the actor's, or another one): the
LM head is dropped, the value head (H -> 1) is new, initialised from ``seed`` with a small normal
(std ``1 / (H + 1)``, as OpenRLHF) and a zero bias. The critic has its own AdamW; one step
accumulates micro-batches with the divisors of the whole mini-batch (as the actor does), under the
clipped value loss of :func:`~rlfleet.trainer.algorithms.value.clipped_value_loss`.

Under several trainer ranks the critic is sharded with FSDP2 like the actor (each decoder block a
unit, the root holding embeddings, final norm and value head): every rank holds the whole batch,
computes the values and gradients of its share of the rows (:func:`~rlfleet.trainer.fsdp.local_rows`),
and the results are summed over ranks, so W ranks produce what one process would.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn
from transformers import AutoModel, PreTrainedModel

from rlfleet.trainer.algorithms.aggregation import LossAgg, aggregate, masked_sum
from rlfleet.trainer.algorithms.value import clipped_value_loss
from rlfleet.trainer.config import OptimizerConfig
from rlfleet.trainer.distributed import DistContext, all_reduce_sum
from rlfleet.trainer.fsdp import local_rows, shard_model
from rlfleet.trainer.inputs import PolicyInputs
from rlfleet.trainer.model_io import disable_dropout, load_pretrained
from rlfleet.trainer.optim import build_optimizer, clipped_step

logger = logging.getLogger(__name__)

CRITIC_METRIC_KEYS = ("vf_loss", "vf_clip_frac", "vpred_mean")
"""The per-step sums :meth:`Critic.forward_backward` returns (prefixed ``critic/``)."""


class CriticConfig(BaseModel):
    """How to build a :class:`Critic`."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(description="local directory of a causal LM (save_pretrained) for the backbone")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="parameter dtype")
    device: str = Field(default="cpu", description="torch device")
    attn_implementation: str | None = Field(
        default=None, description="HF attention kernel; None: HF's choice"
    )
    mixed_precision: Literal["none", "bf16"] = Field(default="none", description="bf16 autocast")
    seed: int = Field(default=0, description="seed of the value head's initialisation")
    value_clip: float | None = Field(default=0.2, gt=0.0, description="value clip range; None: off")
    loss_agg: LossAgg = Field(default="token-mean", description="how per-token value losses reduce")
    optim: OptimizerConfig = Field(default_factory=OptimizerConfig, description="the critic's AdamW")


class ValueModel(nn.Module):
    """A transformer backbone and a linear value head: token ids -> one value per response token."""

    def __init__(self, backbone: PreTrainedModel, *, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = int(backbone.config.hidden_size)
        param = next(backbone.parameters())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = nn.Linear(hidden, 1)
            nn.init.normal_(head.weight, std=1.0 / (hidden + 1))
            nn.init.zeros_(head.bias)
        self.value_head = head.to(device=param.device, dtype=param.dtype)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_len: int
    ) -> Tensor:
        """(B, T) ids, mask and positions -> (B, R) float32 values of the last R tokens."""
        if not 0 < response_len < input_ids.shape[1]:
            raise ValueError(f"response_len must be in (0, T={input_ids.shape[1]}); got {response_len}")
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state[:, -(response_len + 1) : -1]
        return self.value_head(hidden).squeeze(-1).float()


def load_value_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    seed: int = 0,
) -> ValueModel:
    """The backbone of the causal LM in ``path`` with a fresh value head, on ``device``.

    Raises:
        ModelLoadError: the directory does not exist or has no ``config.json``.
    """
    backbone = load_pretrained(AutoModel, path, dtype=dtype, attn_implementation=attn_implementation)
    model = ValueModel(backbone.to(device), seed=seed)
    logger.info("loaded critic backbone %s (%s, %s) from %s", type(backbone).__name__, dtype, device, path)
    return model


class Critic:
    """A value model with its own AdamW, warmup schedule, value clipping and micro-batches."""

    def __init__(self, config: CriticConfig, dist: DistContext | None = None) -> None:
        self.config = config
        self.dist = dist if dist is not None else DistContext(device=torch.device(config.device))
        self.model = load_value_model(
            config.model_path,
            dtype=getattr(torch, config.dtype),
            device="cpu" if self.dist.distributed else config.device,  # FSDP moves the shards over
            attn_implementation=config.attn_implementation,
            seed=config.seed,
        )
        disable_dropout(self.model)
        shard_model(self.model, self.dist, bf16=config.mixed_precision == "bf16")
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), config.optim)
        self.steps = 0

    @property
    def device(self) -> torch.device:
        """Where the value model's parameters (or this rank's shards of them) live."""
        return self.dist.device if self.dist.distributed else next(self.model.parameters()).device

    def _rank_rows(self, rows: Tensor, inputs: PolicyInputs) -> tuple[Tensor, Tensor]:
        """This rank's share of ``rows`` and their weights (1 own, 0 padding), as the actor splits them."""
        share = local_rows(rows, inputs.attention_mask.sum(dim=-1), self.dist.rank, self.dist.world_size)
        return share.rows, share.weights

    def _autocast(self) -> torch.autocast:
        enabled = self.config.mixed_precision == "bf16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _values(self, mb: PolicyInputs) -> Tensor:
        with self._autocast():
            return self.model(mb.input_ids, mb.attention_mask, mb.position_ids, mb.response_len)

    @torch.no_grad()
    def compute_values(self, inputs: PolicyInputs, *, micro_batch_size: int) -> Tensor:
        """Values of the response tokens without grad: inputs (N, P+R) -> (N, R) float32, 0 at padding.

        Under FSDP each rank computes its rows and the results are summed over ranks.
        """
        self.model.eval()
        rows, weights = self._rank_rows(
            torch.arange(inputs.num_samples, device=inputs.input_ids.device), inputs
        )
        out = torch.zeros(inputs.response_mask.shape, dtype=torch.float32, device=inputs.input_ids.device)
        for chunk, weight in zip(rows.split(micro_batch_size), weights.split(micro_batch_size), strict=True):
            mb = inputs.select(chunk)
            real = weight > 0
            out[chunk[real]] = (self._values(mb) * mb.response_mask)[real]
        return all_reduce_sum(out, self.dist)

    def forward_backward(
        self,
        inputs: PolicyInputs,
        rows: Tensor,
        old_values: Tensor,
        returns: Tensor,
        *,
        micro_batch_size: int,
    ) -> dict[str, float]:
        """Accumulate the gradient of the clipped value loss of the mini-batch ``rows`` (K,).

        Args:
            inputs: the whole batch's forward inputs (N, P + R).
            rows: (K,) the mini-batch's rows.
            old_values: (N, R) rollout-time values (the clip centre).
            returns: (N, R) regression targets.
            micro_batch_size: rows per forward/backward.

        Returns:
            ``critic/vf_loss`` (the mini-batch loss), ``critic/vf_clip_frac`` and ``critic/vpred_mean``
            (token means over the mini-batch).
        """
        # every rank holds the whole batch: these divisors are the global ones without a collective
        num_tokens = float(inputs.response_mask[rows].sum().clamp(min=1).item())
        divisors = {"num_tokens": num_tokens, "num_seqs": float(len(rows))}
        grad_scale = float(self.dist.world_size)  # FSDP averages gradients over ranks; the shares must add
        mine, weights = self._rank_rows(rows, inputs)
        self.model.train()
        sums = torch.zeros(len(CRITIC_METRIC_KEYS), dtype=torch.float64, device=self.device)
        for chunk, weight in zip(mine.split(micro_batch_size), weights.split(micro_batch_size), strict=True):
            mb = inputs.select(chunk)
            mask = mb.response_mask * weight[:, None].to(mb.response_mask.device)
            values = self._values(mb)
            per_token, clipped = clipped_value_loss(
                values, old_values[chunk], returns[chunk], clip_eps=self.config.value_clip
            )
            loss = aggregate(per_token, mask, self.config.loss_agg, **divisors)
            (loss * grad_scale if grad_scale != 1.0 else loss).backward()
            shares = (loss.detach(), masked_sum(clipped.float(), mask) / num_tokens,
                      masked_sum(values.detach(), mask) / num_tokens)  # fmt: skip
            sums += torch.stack([share.double().to(sums.device) for share in shares])
        totals = all_reduce_sum(sums, self.dist).tolist()
        return {f"critic/{key}": value for key, value in zip(CRITIC_METRIC_KEYS, totals, strict=True)}

    def optimizer_step(self, max_grad_norm: float | None = 1.0) -> dict[str, float]:
        """Clip, step AdamW and the schedule, zero the gradient; a non-finite norm skips the update.

        Returns:
            ``critic/grad_norm`` (before clipping) and ``critic/lr``.
        """
        grad_norm, lr = clipped_step(list(self.model.parameters()), self.optimizer, self.scheduler,
                                     max_grad_norm, what=f"critic step {self.steps}")  # fmt: skip
        self.steps += 1
        return {"critic/grad_norm": grad_norm, "critic/lr": lr}
