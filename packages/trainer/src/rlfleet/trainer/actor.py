"""The actor: a trainable HF causal LM, its frozen reference, and one RL policy update.

One call to :meth:`Actor.update` on a rollout batch (see the batch contract)::

    batch ──build_policy_inputs──> inputs (N, P+R)
      │  no_grad, micro-batched: old_logprobs (current policy), ref_logprobs (frozen reference)
      v
    for epoch in ppo_epochs:
      for mini-batch in rows (one by default):           ── one optimizer step each
        for micro-batch in mini-batch:                  ── gradient accumulation
          logp, entropy = token_logprobs(policy, micro)
          loss = pg(logp, old, A) - c_H * H + c_KL * KL(logp, ref)   # divisors of the mini-batch
          loss.backward()
        clip grad norm; AdamW step; LR schedule step

Every divisor is the mini-batch's (tokens for ``token-mean``, sequences for ``seq-mean-*``), so
the accumulated gradient equals the gradient of the whole mini-batch's loss. Dropout is disabled:
the first step's ratio is then exactly 1.

Ranks: with a :class:`~rlfleet.trainer.distributed.DistContext` of W > 1 ranks the policy and the
reference are sharded with FSDP2 (:mod:`rlfleet.trainer.fsdp`). Every rank holds the whole batch
(token ids are small) and runs its rows of each mini-batch; the divisors stay the whole
mini-batch's, each rank's loss is scaled by W because FSDP averages gradients over ranks, so W
ranks produce the gradient one process would on the whole batch. No-grad logprobs are computed
rank-wise and summed over ranks, so every rank ends with all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rlfleet.trainer.algorithms.advantages import broadcast_to_tokens
from rlfleet.trainer.config import ActorConfig, PolicyLossConfig, UpdateConfig
from rlfleet.trainer.distributed import DistContext, all_reduce_sum, shared_seed
from rlfleet.trainer.fsdp import local_rows, save_hf_sharded, shard_model
from rlfleet.trainer.inputs import PolicyInputs, build_policy_inputs
from rlfleet.trainer.logprobs import token_logprobs
from rlfleet.trainer.model_io import (
    compile_blocks,
    disable_dropout,
    freeze,
    load_causal_lm,
    save_hf,
    set_seed,
    train_top_layers,
)
from rlfleet.trainer.optim import build_optimizer, clipped_step, mean_over_steps
from rlfleet.trainer.prepared import METRIC_KEYS, PreparedBatch, batch_metrics, micro_batch_loss
from rlfleet.trainer.weights import iter_weight_buckets

logger = logging.getLogger(__name__)


class Actor:
    """A policy model with its optimizer, and (on demand) a frozen reference copy.

    The reference is loaded from ``config.model_path`` the first time it is needed (``kl_coef > 0``
    or ``use_reference``), so that directory must still hold the initial weights then. With a
    ``dist`` of several ranks both models are sharded with FSDP2 (see the module docstring).
    """

    def __init__(self, config: ActorConfig, dist: DistContext | None = None) -> None:
        self.config = config
        self.dist = dist if dist is not None else DistContext(device=torch.device(config.device))
        if config.seed is not None:
            set_seed(config.seed)
        self._dtype = getattr(torch, config.dtype)
        self.model: PreTrainedModel = self._load()
        disable_dropout(self.model)
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.compile:
            compile_blocks(self.model)
        self.model.requires_grad_(True)
        self.trainable: set[str] | None = None
        if config.trainable_layers is not None:
            self.trainable = set(train_top_layers(self.model, config.trainable_layers))
        self._shard(self.model)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(trainable, config.optim)
        self._generator = torch.Generator()
        self._generator.manual_seed(shared_seed(config.seed, self.dist))
        self.ref_model: PreTrainedModel | None = None
        self.steps = 0
        if config.use_reference:
            self.reference()

    def _load(self) -> PreTrainedModel:
        """Load the model: on its device, or on the CPU when FSDP will shard it onto the device."""
        device = "cpu" if self.dist.distributed else self.config.device
        attn = self.config.attn_implementation
        return load_causal_lm(
            self.config.model_path, dtype=self._dtype, device=device, attn_implementation=attn
        )

    def _shard(self, model: PreTrainedModel) -> None:
        """FSDP2 over the ranks (nothing with one rank)."""
        bf16 = self.config.mixed_precision == "bf16"
        shard_model(model, self.dist, bf16=bf16, reshard_after_forward=self.config.reshard_after_forward)

    def _autocast(self) -> torch.autocast:
        """bf16 autocast when ``mixed_precision='bf16'`` in one process (under FSDP its policy casts)."""
        enabled = self.config.mixed_precision == "bf16" and not self.dist.distributed
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    @property
    def device(self) -> torch.device:
        """Where the policy's parameters (or this rank's shards of them) live."""
        return self.dist.device if self.dist.distributed else next(self.model.parameters()).device

    def reference(self) -> PreTrainedModel:
        """The frozen reference model, loaded from ``model_path`` on first use.

        Under FSDP it is sharded like the policy (1/W of its size per rank); its forwards
        all-gather block by block like the policy's.
        """
        if self.ref_model is None:
            ref = freeze(self._load())
            self._shard(ref)
            self.ref_model = ref
        return self.ref_model

    def _rank_rows(self, rows: Tensor, inputs: PolicyInputs) -> tuple[Tensor, Tensor]:
        """This rank's share of ``rows`` (see :func:`rlfleet.trainer.fsdp.local_rows`): rows, weights."""
        share = local_rows(rows, inputs.attention_mask.sum(dim=-1), self.dist.rank, self.dist.world_size)
        return share.rows, share.weights

    @torch.no_grad()
    def compute_logprobs(
        self, inputs: PolicyInputs, *, micro_batch_size: int, reference: bool = False
    ) -> Tensor:
        """Logprobs of the response tokens without grad: inputs (N, P+R) -> (N, R) float32, 0 at padding.

        Under FSDP each rank computes its rows (same number of forwards on every rank) and the
        results are summed over ranks, so every rank returns all N rows.
        """
        model = self.reference() if reference else self.model
        model.eval()
        device = inputs.input_ids.device
        rows, weights = self._rank_rows(torch.arange(inputs.num_samples, device=device), inputs)
        out = torch.zeros(inputs.response_mask.shape, dtype=torch.float32, device=device)
        for chunk, weight in zip(rows.split(micro_batch_size), weights.split(micro_batch_size), strict=True):
            mb = inputs.select(chunk)
            with self._autocast():
                logp, _ = token_logprobs(
                    model,
                    mb.input_ids,
                    mb.attention_mask,
                    mb.response_len,
                    position_ids=mb.position_ids,
                    temperature=self.config.temperature,
                    compute_entropy=False,
                    chunk_rows=self.config.logprob_chunk_rows,
                    compiled=self.config.compile,
                )
            real = weight > 0
            out[chunk[real]] = (logp * mb.response_mask)[real]
        return all_reduce_sum(out, self.dist)

    def prepare(
        self,
        batch: Mapping[str, Tensor],
        advantages: Tensor,
        *,
        micro_batch_size: int,
        with_reference: bool = False,
        recompute_old: bool = True,
    ) -> PreparedBatch:
        """Build inputs, recompute old (and reference) logprobs, spread advantages over tokens.

        Args:
            batch: a rollout batch per the batch contract (extra keys are ignored).
            advantages: (N,) per sample or (N, R) per token.
            micro_batch_size: samples per no-grad forward.
            with_reference: also compute reference logprobs (loads the reference if needed).
            recompute_old: compute old logprobs now; False for an on-policy single step.
        """
        inputs = build_policy_inputs(batch).to(self.device)
        token_adv = broadcast_to_tokens(advantages.to(self.device).float(), inputs.response_mask)
        rollout = batch.get("rollout_logprobs")
        old = self.compute_logprobs(inputs, micro_batch_size=micro_batch_size) if recompute_old else None
        ref = None
        if with_reference:
            ref = self.compute_logprobs(inputs, micro_batch_size=micro_batch_size, reference=True)
        rollout = None if rollout is None else rollout.to(self.device).float()
        return PreparedBatch(inputs, old, token_adv, ref_logprobs=ref, rollout_logprobs=rollout)

    def forward_backward(
        self,
        prepared: PreparedBatch,
        rows: Tensor,
        *,
        micro_batch_size: int,
        loss: PolicyLossConfig,
        collect_old: Tensor | None = None,
    ) -> dict[str, float]:
        """Accumulate into ``.grad`` the gradient of the loss of the mini-batch ``rows`` (K,).

        Micro-batches of ``micro_batch_size`` rows each add their share; the divisors are the
        mini-batch's, so the sum equals the mini-batch loss. No optimizer step, no zeroing.
        Under FSDP ``rows`` is the whole mini-batch (the same on every rank); each rank runs its
        share of it. Without ``prepared.old_logprobs`` (on-policy), each pass's detached logprobs
        serve as the old ones and are written into ``collect_old`` (N, R) when given (each rank
        writes its own rows).

        Returns:
            the mini-batch's ``loss``, ``pg_loss``, ``entropy`` (token mean), ``clip_frac``,
            ``approx_kl``, and ``kl_loss`` when ``kl_coef > 0`` (over all ranks).
        """
        if loss.kl_coef > 0 and prepared.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs: prepare(..., with_reference=True)")
        # every rank holds the whole batch, so these divisors are the global ones without a collective
        num_tokens = float(prepared.inputs.response_mask[rows].sum().clamp(min=1).item())
        divisors = {"num_tokens": num_tokens, "num_seqs": float(len(rows))}
        grad_scale = float(self.dist.world_size)  # FSDP averages gradients over ranks; the shares must add
        mine, weights = self._rank_rows(rows, prepared.inputs)
        self.model.train()
        sums = torch.zeros(len(METRIC_KEYS), dtype=torch.float64, device=self.device)
        for chunk, weight in zip(mine.split(micro_batch_size), weights.split(micro_batch_size), strict=True):
            mb = prepared.inputs.select(chunk)
            with self._autocast():
                logp, entropy = token_logprobs(
                    self.model,
                    mb.input_ids,
                    mb.attention_mask,
                    mb.response_len,
                    position_ids=mb.position_ids,
                    temperature=self.config.temperature,
                    chunk_rows=self.config.logprob_chunk_rows,
                    compiled=self.config.compile,
                )
            assert entropy is not None
            mask = mb.response_mask * weight[:, None]
            if prepared.old_logprobs is not None:
                old = prepared.old_logprobs[chunk]
            else:
                old = logp.detach()
                if collect_old is not None:
                    real = weight > 0
                    collect_old[chunk[real]] = (old * mask)[real]
            ref = None if prepared.ref_logprobs is None else prepared.ref_logprobs[chunk]
            total, shares = micro_batch_loss(
                logp, entropy, old, prepared.advantages[chunk], mask, ref, loss, **divisors
            )
            (total * grad_scale if grad_scale != 1.0 else total).backward()
            sums += torch.stack([shares[key] for key in METRIC_KEYS])
        values = dict(zip(METRIC_KEYS, all_reduce_sum(sums, self.dist).tolist(), strict=True))
        if loss.kl_coef <= 0:
            del values["kl_loss"]
        return values

    def optimizer_step(self, max_grad_norm: float | None = 1.0) -> dict[str, float]:
        """Clip the accumulated gradient, step AdamW and the LR schedule, zero the gradient.

        A non-finite gradient norm skips the parameter update (logged) but still counts the step.

        Returns:
            ``grad_norm`` (before clipping) and ``lr`` (the rate this step used).
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm, lr = clipped_step(params, self.optimizer, self.scheduler, max_grad_norm,
                                     what=f"actor step {self.steps}")  # fmt: skip
        self.steps += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def update(
        self,
        batch: Mapping[str, Tensor],
        advantages: Tensor,
        *,
        micro_batch_size: int,
        kl_coef: float = 0.0,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        clip_ratio_c: float | None = None,
        entropy_coef: float = 0.0,
        kl_estimator: str = "k3",
        loss_agg: str = "token-mean",
        max_grad_norm: float | None = 1.0,
        ppo_epochs: int = 1,
        mini_batch_size: int | None = None,
        shuffle: bool = True,
    ) -> dict[str, float]:
        """One policy update on a rollout batch: by default one optimizer step over the whole batch.

        Args:
            batch: rollout batch per the batch contract; ``rollout_logprobs`` is optional.
            advantages: (N,) per sample or (N, R) per token.
            micro_batch_size: samples per forward/backward.
            kl_coef, clip_eps, clip_eps_high, clip_ratio_c, entropy_coef, kl_estimator, loss_agg:
                see :class:`PolicyLossConfig`.
            max_grad_norm, ppo_epochs, mini_batch_size, shuffle: see :class:`UpdateConfig`.

        Returns:
            metrics: ``loss``, ``pg_loss``, ``entropy``, ``clip_frac``, ``approx_kl``, ``grad_norm``, ``lr``
            (means over optimizer steps), ``response_length`` (mean tokens), ``num_optimizer_steps``;
            ``rollout_logprob_diff`` (mean |old - rollout| logprob, a weight-sync health check) when the
            batch has ``rollout_logprobs``; ``kl`` (token-mean k3 of the pre-update policy vs the
            reference) when a reference is in use; ``kl_loss`` when ``kl_coef > 0``.
        """
        loss = PolicyLossConfig(
            clip_eps=clip_eps, clip_eps_high=clip_eps_high, clip_ratio_c=clip_ratio_c, kl_coef=kl_coef,
            kl_estimator=kl_estimator, entropy_coef=entropy_coef, loss_agg=loss_agg,
        )  # fmt: skip
        plan = UpdateConfig(
            micro_batch_size=micro_batch_size, mini_batch_size=mini_batch_size, ppo_epochs=ppo_epochs,
            max_grad_norm=max_grad_norm, shuffle=shuffle,
        )  # fmt: skip
        with_ref = loss.kl_coef > 0 or self.ref_model is not None
        n = int(batch["response_ids"].shape[0])
        on_policy = plan.ppo_epochs == 1 and (plan.mini_batch_size is None or plan.mini_batch_size >= n)
        prepared = self.prepare(
            batch, advantages, micro_batch_size=micro_batch_size, with_reference=with_ref,
            recompute_old=not on_policy,
        )  # fmt: skip
        if not on_policy:
            metrics = batch_metrics(prepared)
            metrics.update(self._run_steps(prepared, loss, plan))
            return metrics
        old = torch.zeros_like(prepared.advantages)
        steps = self._run_steps(prepared, loss, plan, collect_old=old)
        all_reduce_sum(old, self.dist)  # each rank wrote its own rows
        metrics = batch_metrics(replace(prepared, old_logprobs=old))
        metrics.update(steps)
        return metrics

    def _run_steps(
        self,
        prepared: PreparedBatch,
        loss: PolicyLossConfig,
        plan: UpdateConfig,
        collect_old: Tensor | None = None,
    ) -> dict[str, float]:
        """The epoch/mini-batch loop of :meth:`update`; returns per-step metrics averaged over steps."""
        n = prepared.inputs.num_samples
        mini = plan.mini_batch_size or n
        per_step: list[dict[str, float]] = []
        for _ in range(plan.ppo_epochs):
            if plan.shuffle and mini < n:
                order = torch.randperm(n, generator=self._generator)
            else:
                order = torch.arange(n)
            for rows in order.to(self.device).split(mini):
                step = self.forward_backward(
                    prepared, rows, micro_batch_size=plan.micro_batch_size, loss=loss, collect_old=collect_old
                )
                step.update(self.optimizer_step(plan.max_grad_norm))
                per_step.append(step)
        return mean_over_steps(per_step)

    def iter_weight_buckets(
        self,
        bucket_bytes: int,
        *,
        dtype: torch.dtype | None = None,
        include_tied: bool = False,
        pin_memory: bool = False,
        on_device: bool = False,
    ) -> Iterator[dict[str, Tensor]]:
        """The policy's trainable state dict in buckets, kept by rank 0 (``{}`` on other ranks).

        Under FSDP every rank must iterate to the end; see :mod:`rlfleet.trainer.weights`.
        """
        return iter_weight_buckets(
            self.model, bucket_bytes, dtype=dtype, include_tied=include_tied, only=self.trainable,
            keep=self.dist.is_main, pin_memory=pin_memory, on_device=on_device and self.dist.is_main,
        )  # fmt: skip

    def save_hf(self, path: str | Path) -> Path:
        """Save the policy (safetensors + config) and the source directory's tokenizer files to ``path``.

        Under FSDP every rank must call it (see :func:`rlfleet.trainer.fsdp.save_hf_sharded`).
        """
        if self.dist.distributed:
            return save_hf_sharded(self.model, path, self.dist.is_main, source_dir=self.config.model_path)
        return save_hf(self.model, path, source_dir=self.config.model_path)
