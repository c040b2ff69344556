"""PPO's critic: a value model (an HF transformer backbone plus a linear value head) and its optimizer.

The value of response token t is read from the hidden state of the position *before* it (the
state in which token t was chosen), exactly as the logits that give its logprob::

    input_ids  (B, P + R) ──backbone──> hidden (B, P + R, H) ──[:, -(R+1):-1]──> (B, R, H)
                                                              ──value_head──> values (B, R)

The backbone is ``AutoModel`` loaded from a causal-LM checkpoint (the actor's, or another one): the
LM head is dropped, the value head (H -> 1) is new, initialised from ``seed`` with a small normal
(std ``1 / (H + 1)``, as OpenRLHF) and a zero bias. The critic has its own AdamW; its steps run in
the update loop (:mod:`rlfleet.trainer.loop`) with PPO's clipped value loss
(:class:`~rlfleet.trainer.algorithms.ppo.ValueObjective`), micro-batched like the policy's.

Under several trainer ranks the critic is sharded with FSDP2 like the actor (each decoder block a
unit, the root holding embeddings, final norm and value head): every rank holds the whole batch,
computes the values and gradients of its share of the rows (:func:`~rlfleet.trainer.policy.local_rows`),
and the results are summed over ranks, so W ranks produce what one process would.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn
from transformers import AutoModel, PreTrainedModel

from rlfleet.common.schema.trainer import ModelSettings
from rlfleet.trainer.distributed import DistContext, shard_model
from rlfleet.trainer.loop import Trainable, placement
from rlfleet.trainer.model_io import disable_dropout, load_pretrained
from rlfleet.trainer.policy import PolicyInputs, forward_rows, pad_response, trim_response_padding

logger = logging.getLogger(__name__)


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
        width = response_len
        input_ids, attention_mask, position_ids, response_len = trim_response_padding(
            input_ids, attention_mask, position_ids, response_len
        )
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state[:, -(response_len + 1) : -1]
        return pad_response(self.value_head(hidden).squeeze(-1).float(), width)


def load_value_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
) -> ValueModel:
    """The backbone of the causal LM in ``path`` with a fresh value head, on ``device``.

    Raises:
        ModelLoadError: the directory does not exist or has no ``config.json``.
    """
    backbone = load_pretrained(AutoModel, path, dtype=dtype, attn_implementation=attn_implementation,
                               trust_remote_code=trust_remote_code)  # fmt: skip
    model = ValueModel(backbone.to(device), seed=seed)
    logger.info("loaded critic backbone %s (%s, %s) from %s", type(backbone).__name__, dtype, device, path)
    return model


class Critic(Trainable):
    """A value model with its own AdamW and warm-up schedule; its loss is PPO's
    (:class:`~rlfleet.trainer.algorithms.ppo.ValueObjective`).

    Args:
        model_path: local directory of a causal LM (``save_pretrained``) for the backbone.
        model: how the trainer holds its models (``param_dtype``, ``mixed_precision``; the critic
            is sharded like the actor over ``dist``'s ranks).
        dist: the trainer's ranks; None: one process on ``device``.
        device: the device of a single process.
        seed: seed of the value head's initialisation.
        learning_rate, weight_decay: the optimizer's until a step sets its own (``set_rates``).
        warmup_steps: optimizer steps of linear warm-up (0: none).
        attn_implementation: HF attention kernel; None: HF's choice.
    """

    role: ClassVar[str] = "critic"
    metric_prefix: ClassVar[str] = "critic/"

    def __init__(
        self,
        model_path: str | Path,
        model: ModelSettings | None = None,
        dist: DistContext | None = None,
        *,
        device: str = "cpu",
        seed: int = 0,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        attn_implementation: str | None = None,
    ) -> None:
        settings, dist, bf16 = placement(model, dist, device)
        value_model = load_value_model(
            model_path,
            dtype=getattr(torch, settings.param_dtype),
            device="cpu" if dist.distributed else dist.device,  # FSDP moves the shards over
            attn_implementation=attn_implementation,
            seed=seed,
            trust_remote_code=settings.trust_remote_code,
        )
        disable_dropout(value_model)
        shard_model(value_model, dist, bf16=bf16)
        super().__init__(value_model, dist, bf16=bf16, learning_rate=learning_rate, weight_decay=weight_decay,
                         warmup_steps=warmup_steps)  # fmt: skip

    def values(self, mb: PolicyInputs) -> Tensor:
        """Values of one micro-batch's response tokens (with grad when enabled): (B, P + R) -> (B, R)."""
        with self.computing():
            return self.model(mb.input_ids, mb.attention_mask, mb.position_ids, mb.response_len)

    @torch.no_grad()
    def compute_values(self, inputs: PolicyInputs, *, micro_batch_size: int) -> Tensor:
        """Values of the response tokens without grad: inputs (N, P+R) -> (N, R) float32, 0 at padding.

        Under FSDP each rank computes its rows and the results are summed over ranks.
        """
        self.model.eval()
        return forward_rows(inputs, micro_batch_size, self.dist, self.values)
