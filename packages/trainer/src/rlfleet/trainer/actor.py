"""The actor: a trainable HF causal LM, its optimizer and its frozen reference, loaded and held.

The actor holds the models; a step runs them elsewhere: the policy's forward (token logprobs with
and without grad, each rank's rows) is :mod:`rlfleet.trainer.policy`, the losses are the
algorithms' (:mod:`rlfleet.trainer.algorithms`) and the update loop, with the clipped AdamW step,
is :mod:`rlfleet.trainer.loop` (:class:`~rlfleet.trainer.loop.Trainable`). Nothing here runs
during a step, except loading the reference the first time a step needs it.

Dropout is disabled: the first step's ratio is then exactly 1.

Ranks: with a :class:`~rlfleet.trainer.distributed.DistContext` of W > 1 ranks the policy and the
reference are sharded with FSDP2 (:mod:`rlfleet.trainer.distributed`).

LoRA (``model.lora``, one process or FSDP ranks): the policy gets PEFT adapters (before it is
sharded) and only they train; the reference is the policy with its adapters off; publishes carry
the weights merged or the adapter alone, exports both (:mod:`rlfleet.trainer.lora`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import torch
from peft import PeftModel
from torch import Tensor
from transformers import PreTrainedModel

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.trainer import ModelSettings
from rlfleet.trainer.distributed import DistContext, gathered_state, save_hf_sharded, shard_model, shared_seed
from rlfleet.trainer.loop import Trainable, placement
from rlfleet.trainer.lora import (
    AdapterOff,
    adapter_state,
    add_adapters,
    lora_params,
    merged_state,
    save_adapter,
)
from rlfleet.trainer.model_io import (
    compile_blocks,
    disable_dropout,
    freeze,
    load_causal_lm,
    save_hf,
    set_seed,
    train_top_layers,
)
from rlfleet.trainer.policy import DEFAULT_CHUNK_ROWS
from rlfleet.trainer.weights import iter_weight_buckets

logger = logging.getLogger(__name__)


class Actor(Trainable):
    """A policy model with its optimizer, and (on demand) a frozen reference copy.

    Args:
        model_path: local HF directory (``save_pretrained``) of the policy; the reference is
            loaded from it the first time it is needed, so it must still hold the initial weights.
        model: how the trainer holds the model (dtype, precision, trained layers, sharding,
            gradient checkpointing); ``sharding`` is used by ``dist``'s mesh.
        dist: the trainer's ranks; None: one process on ``device``.
        device: the device of a single process (ranks use theirs).
        seed: torch seed at construction and of the mini-batch shuffle; None: drawn (and shared).
        learning_rate, weight_decay: the optimizer's until a step sets its own (``set_rates``).
        warmup_steps: optimizer steps of linear warm-up (0: none).
        attn_implementation: HF attention kernel (``sdpa``, ``eager``...); None lets HF choose.
        reshard_after_forward: FSDP frees each block's gathered weights after its forward (ZeRO-3);
            False keeps them for backward (more memory, one all-gather less per block and micro-batch).
        compile: ``torch.compile`` the decoder blocks (the policy's and the reference's) and the
            logprob reduction, with dynamic shapes (the first step compiles each variant once; new
            sequence lengths and row counts reuse it); None: the settings' ``compile``.
        logprob_chunk_rows: tokens per chunk of the logprob reduction.
    """

    role: ClassVar[str] = "actor"
    model: PreTrainedModel

    def __init__(
        self,
        model_path: str | Path,
        model: ModelSettings | None = None,
        dist: DistContext | None = None,
        *,
        device: str = "cpu",
        seed: int | None = 0,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        attn_implementation: str | None = None,
        reshard_after_forward: bool = True,
        compile: bool | None = None,
        logprob_chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        self.model_path = str(model_path)
        self.settings, dist, bf16 = placement(model, dist, device)
        if seed is not None:
            set_seed(seed)
        self._dtype = getattr(torch, self.settings.param_dtype)
        self._attn = attn_implementation
        self._reshard = reshard_after_forward
        self.compiled = self.settings.compile if compile is None else compile
        self.logprob_chunk_rows = logprob_chunk_rows
        # one process only: FSDP ranks gather every block in lockstep, so the check a model gets on
        # first use (one rank's extra forwards) would desynchronise them
        self.share_prompts = self.settings.share_prompts and not self.compiled and not dist.distributed
        policy = self._load(dist)
        disable_dropout(policy)
        self.peft: PeftModel | None = None  # LoRA: the PEFT model around the policy (lora.py)
        if self.settings.lora is not None:
            self.peft = self._adapt(policy)  # only the adapters train
        if self.settings.gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.compiled:
            compile_blocks(policy)
        if self.peft is None:
            policy.requires_grad_(True)
        self.trainable: set[str] | None = None
        if self.settings.trainable_layers is not None:
            self.trainable = set(train_top_layers(policy, self.settings.trainable_layers))
        shard_model(policy, dist, bf16=bf16, reshard_after_forward=reshard_after_forward)
        super().__init__(policy, dist, bf16=bf16, learning_rate=learning_rate, weight_decay=weight_decay,
                         warmup_steps=warmup_steps)  # fmt: skip
        self.generator = torch.Generator()
        self.generator.manual_seed(shared_seed(seed, dist))
        self.ref_model: PreTrainedModel | None = None

    def _adapt(self, policy: PreTrainedModel) -> PeftModel:
        """LoRA adapters on ``policy`` (in place, before FSDP shards it), after checking the settings
        allow them."""
        lora = self.settings.lora
        assert lora is not None
        if self.settings.trainable_layers is not None:
            raise ConfigError("model.lora", lora.model_dump(), "trains adapters instead of layers: unset "
                              "model.trainable_layers")  # fmt: skip
        return add_adapters(policy, lora)

    def _load(self, dist: DistContext) -> PreTrainedModel:
        """Load the model: on its device, or on the CPU when FSDP will shard it onto the device."""
        device = "cpu" if dist.distributed else dist.device
        return load_causal_lm(
            self.model_path, dtype=self._dtype, device=device, attn_implementation=self._attn,
            trust_remote_code=self.settings.trust_remote_code,
        )  # fmt: skip

    def reference(self) -> PreTrainedModel:
        """The frozen reference model, loaded from ``model_path`` on first use.

        Under FSDP it is sharded like the policy (1/W of its size per rank); its forwards
        all-gather block by block like the policy's.
        """
        if self.ref_model is None and self.peft is not None:  # the base: the policy, adapters off
            self.ref_model = AdapterOff(self.model, self.peft)
        if self.ref_model is None:
            ref = freeze(self._load(self.dist))
            if self.compiled:
                compile_blocks(ref)
            shard_model(ref, self.dist, bf16=self.bf16, reshard_after_forward=self._reshard)
            self.ref_model = ref
        return self.ref_model

    def iter_weight_buckets(
        self,
        bucket_bytes: int,
        *,
        dtype: torch.dtype | None = None,
        include_tied: bool = False,
        pin_memory: bool = False,
        on_device: bool = False,
        adapter: bool = False,
    ) -> Iterator[dict[str, Tensor]]:
        """The policy's trainable state dict in buckets, kept by rank 0 (``{}`` on other ranks).

        LoRA: the weights with the adapters merged, or with ``adapter`` the adapter's tensors alone
        (PEFT's names, :func:`rlfleet.trainer.lora.adapter_state`). Under FSDP every rank must
        iterate to the end; see :mod:`rlfleet.trainer.weights`.
        """
        merged = None
        if self.peft is not None:  # LoRA: what the engines load
            merged = adapter_state(self.peft) if adapter else merged_state(self.model)
        return iter_weight_buckets(
            self.model, bucket_bytes, dtype=dtype, include_tied=include_tied, only=self.trainable,
            keep=self.dist.is_main, pin_memory=pin_memory, on_device=on_device and self.dist.is_main,
            state=merged,
        )  # fmt: skip

    def save_hf(self, path: str | Path) -> Path:
        """Save the policy (safetensors + config) and the source directory's tokenizer files to ``path``;
        LoRA: the weights merged, and the adapter in PEFT's format in ``path/adapter``.

        Under FSDP every rank must call it (see :func:`rlfleet.trainer.distributed.save_hf_sharded`).
        """
        if self.peft is not None:
            return self._save_lora(Path(path))
        if self.dist.distributed:
            return save_hf_sharded(self.model, path, self.dist.is_main, source_dir=self.model_path)
        return save_hf(self.model, path, source_dir=self.model_path)

    def _save_lora(self, path: Path) -> Path:
        """LoRA's export: the merged model in HF format in ``path``, the adapter in PEFT's format in
        ``path/adapter``. Under FSDP every rank gathers both, rank 0 writes."""
        assert self.peft is not None
        merged, adapter = merged_state(self.model), lora_params(self.peft)
        if self.dist.distributed:
            merged = gathered_state(self.model, self.dist.is_main, state=merged)
            adapter = gathered_state(self.model, self.dist.is_main, state=adapter)
        if self.dist.is_main:
            save_hf(self.model, path, source_dir=self.model_path, state_dict=merged)
            save_adapter(self.peft, path / "adapter", adapter)
        if self.dist.distributed:
            torch.distributed.barrier()  # written before any rank goes on
        return path
