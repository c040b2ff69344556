"""LoRA on the actor (``model.lora``): PEFT adapters on the policy, the base with them switched off
as the reference, and the merged weights the rollout engines load.

:func:`add_adapters` wraps the loaded policy in a PEFT model: every linear layer named in
``target_modules`` gets ``A`` (rank x in, PEFT's Kaiming init) and ``B`` (out x rank, zeros), so the
adapted model starts equal to the base; only ``A`` and ``B`` require grad, so the optimizer (and its
state, and a checkpoint's) holds the adapters alone.

The reference is :class:`AdapterOff`: the same module run with every adapter disabled, which is
exactly the base model, so no second copy of the weights is loaded.

The rollout engines serve plain HF checkpoints. Each publish sends them the adapted layers'
weights merged, ``W + (alpha / rank) B A``, under their HF names (:func:`merged_weights`); the
engines already hold every other weight, unchanged since they loaded the base. Export writes the
merged model and, beside it in ``adapter/``, the adapter in PEFT's format (``save_pretrained``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

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
        out[f"{name}.weight"] = base + (b.float() @ a.float()).to(base.dtype) * layer.scaling[ADAPTER]
    return out


def merged_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapted HF model's whole state dict by HF name, adapted layers merged (what an export
    saves: a plain checkpoint of the trained policy)."""
    state = {hf_name(n): t for n, t in model.state_dict().items() if ".lora_" not in n}
    state.update(merged_weights(model))
    return state


class AdapterOff(nn.Module):
    """The reference: the adapted HF model ``model`` run with its adapters disabled (``peft``'s
    switch), which is the base model; no second copy of the weights."""

    def __init__(self, model: nn.Module, peft: PeftModel) -> None:
        super().__init__()
        self.inner = model
        self._peft = [peft]  # not a submodule: its parameters are the inner model's

    @property
    def config(self) -> Any:
        return self.inner.config

    def forward(self, *args: Any, logits_to_keep: int | Tensor = 0, **kwargs: Any) -> Any:
        with self._peft[0].disable_adapter():
            return self.inner(*args, logits_to_keep=logits_to_keep, **kwargs)


def save_adapter(model: PeftModel, path: str | Path) -> Path:
    """The adapter in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``) in ``path``."""
    model.save_pretrained(str(path))
    return Path(path)
