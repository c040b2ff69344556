"""LoRA on the actor (``model.lora``): PEFT adapters on the policy, the base with them switched off
as the reference, and the merged weights the rollout engines load.

:func:`add_adapters` wraps the loaded policy in a PEFT model: every linear layer named in
``target_modules`` gets ``A`` (rank x in, PEFT's Kaiming init) and ``B`` (out x rank, zeros), so the
adapted model starts equal to the base; only ``A`` and ``B`` require grad, so the optimizer (and its
state, and a checkpoint's) holds the adapters alone.

The reference is :class:`AdapterOff`: the same module run with every adapter disabled, which is
exactly the base model, so no second copy of the weights is loaded.

Under FSDP2 ranks the adapters are added before the model is sharded, so each block's FSDP unit
holds its frozen base weights and its adapters alike (``fully_shard`` gathers both and
reduce-scatters gradients only for the adapters). The merged weights are computed on each rank's
rows (:func:`merged_weights`: ``W`` and ``B`` are split alike by output rows; ``A``, ``rank x
in``, is gathered whole), and stay shards for the publish or export to gather.

The rollout engines get either the adapter alone (``weight_sync.adapter``, the default: its
tensors under PEFT's names, :func:`adapter_state`; the engines apply it to the base they hold) or
the weights merged, ``W + (alpha / rank) B A``, under their HF names (:func:`merged_weights`; the
whole state, :func:`merged_state`). Export writes the merged model and, beside it in ``adapter/``,
the adapter in PEFT's format (``save_pretrained``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.trainer import LoraSettings

ADAPTER = "default"
"""PEFT's name of the one adapter the actor trains."""


def add_adapters(model: nn.Module, settings: LoraSettings) -> PeftModel:
    """``model`` with trainable LoRA adapters on its ``target_modules`` (its own weights frozen),
    wrapped in a PEFT model. The adapters are injected into ``model`` itself, which stays the module
    a step runs (``peft.base_model.model``: the HF model, adapted, with HF's forward arguments)."""
    names = {
        name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)
    }
    missing = sorted(set(settings.target_modules) - names)
    if missing:
        raise ConfigError("model.lora.target_modules", settings.target_modules,
                          f"{missing} name no linear layer of this model (it has {sorted(names)})",
                          )  # fmt: skip
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), bias="none")  # fmt: skip
    return get_peft_model(model, config, adapter_name=ADAPTER)


def hf_name(name: str) -> str:
    """An adapted model's state-dict name as the base model's (``.base_layer`` dropped)."""
    return name.replace(".base_layer.", ".")


def _adapted(model: nn.Module) -> Iterator[tuple[str, LoraLayer]]:
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name, module


@torch.no_grad()
def merged_weights(model: nn.Module) -> dict[str, Tensor]:
    """Each adapted layer's weight with its adapter merged in, ``W + scale * B A``, by HF name
    (``model``: the adapted HF model)."""
    out: dict[str, Tensor] = {}
    for name, layer in _adapted(model):
        base = layer.get_base_layer().weight
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        out[f"{name}.weight"] = _merge(base, a, b, layer.scaling[ADAPTER])
    return out


def _merge(base: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``base + scale * b @ a``; under FSDP (DTensor shards, collective) each rank's rows of it,
    a shard like ``base``'s."""
    if not isinstance(base, DTensor):
        return base + (b.float() @ a.float()).to(base.dtype) * scale
    assert isinstance(a, DTensor) and isinstance(b, DTensor) and b.placements == base.placements
    # W (out x in) and B (out x rank) are split alike by rows; A (rank x in) is small: gathered whole
    rows = base.to_local() + (b.to_local().float() @ a.full_tensor().float()).to(base.dtype) * scale
    return DTensor.from_local(rows, base.device_mesh, base.placements, run_check=False, shape=base.shape,
                              stride=base.stride())  # fmt: skip


def merged_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapted HF model's whole state dict by HF name, adapted layers merged (what an export
    saves: a plain checkpoint of the trained policy). The unadapted entries are the parameters
    themselves (a tied ``lm_head`` stays one tensor with the embedding, as
    :func:`rlfleet.trainer.weights.iter_weight_buckets` expects); under FSDP all are shards."""
    state = {hf_name(n): t for n, t in model.state_dict(keep_vars=True).items() if ".lora_" not in n}
    state.update(merged_weights(model))
    return state


class AdapterOff(nn.Module):
    """The reference: the adapted HF model ``model`` run with its adapters disabled (``peft``'s
    switch), which is the base model; no second copy of the weights.

    PEFT's switch also turns the adapters' ``requires_grad`` off; it is turned back on inside the
    switch (this forward does not use the adapters). FSDP2 sets each block's gradient dtypes from
    the parameters that require grad at its first forward, which is the reference's in a DPO step:
    with none, it would reduce the adapters' gradients in the compute dtype (bf16 on GPU), not in
    float32, and not cast them back to the parameters' dtype.
    """

    def __init__(self, model: nn.Module, peft: PeftModel) -> None:
        super().__init__()
        self.inner = model
        self._peft = [peft]  # not a submodule: its parameters are the inner model's

    @property
    def config(self) -> Any:
        return self.inner.config

    def forward(self, *args: Any, logits_to_keep: int | Tensor = 0, **kwargs: Any) -> Any:
        trainable = [p for p in self.inner.parameters() if p.requires_grad]
        with self._peft[0].disable_adapter():
            for param in trainable:
                param.requires_grad_(True)
            return self.inner(*args, logits_to_keep=logits_to_keep, **kwargs)


def save_adapter(model: PeftModel, path: str | Path, state: dict[str, Tensor] | None = None) -> Path:
    """The adapter in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``) in ``path``.

    ``state``: the adapter's full tensors by the PEFT model's names (:func:`lora_params`, gathered
    under FSDP); None: the model's own."""
    model.save_pretrained(str(path), **({"state_dict": state} if state is not None else {}))
    return Path(path)


def lora_params(peft: PeftModel) -> dict[str, Tensor]:
    """The adapters' parameters by the PEFT model's own state-dict names (with the adapter's name,
    as ``save_pretrained``'s ``state_dict`` takes them); shards under FSDP."""
    return {name: t for name, t in peft.state_dict(keep_vars=True).items() if ".lora_" in name}


def adapter_state(peft: PeftModel) -> dict[str, Tensor]:
    """The adapter's tensors as PEFT saves them (``adapter_model.safetensors``: names such as
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, the adapter's own name
    dropped): what an adapter publish sends the engines."""
    return {name: t.detach() for name, t in get_peft_model_state_dict(peft, adapter_name=ADAPTER).items()}
