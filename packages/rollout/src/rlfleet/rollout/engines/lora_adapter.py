"""A published LoRA adapter as the engines take it (``LoadWeights.adapter``, wire 2.8).

A LoRA run's trainer may publish its adapter alone: per adapted linear layer ``W`` (HF name
``<layer>.weight``) the tensors ``base_model.model.<layer>.lora_A.weight`` (rank x in) and
``...lora_B.weight`` (out x rank), PEFT's saved names, with the run's :class:`LoraSettings`. The
adapted layer computes ``W x + (alpha / rank) B A x``.

:func:`parse_adapter` checks an adapter whole against the engine's weights before anything changes
(every name maps to a weight the engine holds, both halves present, shapes agree with the weight
and the rank, floating and finite values): a bad adapter is refused with :class:`BadAdapter`
naming the tensor. The HF engine applies it by merging (:func:`merged`) into the base weights it
keeps; the vLLM engine serves it as a LoRA adapter from a PEFT directory (:func:`write_peft_dir`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlfleet.common.schema.trainer import LoraSettings
from rlfleet.rollout.errors import BadAdapter

PREFIX = "base_model.model."
"""PEFT's prefix of an adapter's tensor names (the model wrapped twice: PeftModel, LoraModel)."""
HALVES = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class LayerAdapter:
    """One adapted layer: ``a`` (rank x in) and ``b`` (out x rank) for the weight ``name``."""

    name: str
    a: torch.Tensor
    b: torch.Tensor


def parse_adapter(
    items: list[tuple[str, torch.Tensor]], settings: LoraSettings, shapes: Mapping[str, tuple[int, ...]]
) -> list[LayerAdapter]:
    """The adapter's layers, each checked against ``shapes`` (the engine's weights by HF name).

    Raises :class:`BadAdapter` for a name that is not an adapter half of a weight the engine holds,
    a layer missing a half, a shape that does not fit the weight or ``settings.rank``, a tensor that
    is not floating point or holds a non-finite value, or no layer at all.
    """
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        half = next((h for h in HALVES if name.endswith(h)), None)
        if not name.startswith(PREFIX) or half is None:
            raise BadAdapter(
                name, f"not a LoRA adapter tensor name ({PREFIX}<layer>.lora_A.weight or lora_B)"
            )
        layer = name[len(PREFIX) : -len(half)] + ".weight"
        if layer not in shapes:
            raise BadAdapter(name, f"adapts {layer!r}, which this engine's model does not have")
        if not tensor.is_floating_point():
            raise BadAdapter(name, f"dtype {tensor.dtype} is not floating point")
        halves.setdefault(layer, {})[half] = tensor
    if not halves:
        raise BadAdapter("", "the adapter has no tensors")
    rank = settings.rank
    layers = []
    for layer, pair in halves.items():
        missing = [h for h in HALVES if h not in pair]
        if missing:
            raise BadAdapter(
                PREFIX + layer[: -len(".weight")] + missing[0], "missing: a layer needs both halves"
            )
        a, b = pair[HALVES[0]], pair[HALVES[1]]
        shape = tuple(shapes[layer])
        if len(shape) != 2:
            raise BadAdapter(PREFIX + layer, f"adapts a weight of shape {shape}, not a linear layer's matrix")
        out, inp = shape
        if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
            raise BadAdapter(PREFIX + layer, f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                             f"fit a weight of shape {shape} at rank {rank}")  # fmt: skip
        for half, t in ((HALVES[0], a), (HALVES[1], b)):
            if not bool(torch.isfinite(t).all()):
                raise BadAdapter(PREFIX + layer[: -len(".weight")] + half, "holds a non-finite value")
        layers.append(LayerAdapter(layer, a, b))
    return layers


def scale(settings: LoraSettings) -> float:
    """The factor of ``B A``: ``alpha / rank`` (PEFT's default scaling)."""
    return settings.alpha / settings.rank


def merged(base: torch.Tensor, adapter: LayerAdapter, factor: float) -> torch.Tensor:
    """``base + factor * B A`` (computed in float32), in ``base``'s dtype and device."""
    delta = adapter.b.to(base.device, torch.float32) @ adapter.a.to(base.device, torch.float32)
    out = base.to(torch.float32) + delta * factor
    if not math.isfinite(float(out.abs().max())):
        raise BadAdapter(PREFIX + adapter.name, "merged into its weight, it gives non-finite values")
    return out.to(base.dtype)


def write_peft_dir(path: Path, layers: list[LayerAdapter], settings: LoraSettings) -> Path:
    """The adapter as a PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``) in
    ``path``: what vLLM loads as a LoRA adapter."""
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers:
        stem = PREFIX + layer.name[: -len(".weight")]
        tensors[stem + HALVES[0]] = layer.a.detach().to("cpu").contiguous()
        tensors[stem + HALVES[1]] = layer.b.detach().to("cpu").contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    modules = sorted({layer.name[: -len(".weight")].rsplit(".", 1)[-1] for layer in layers})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
              "lora_dropout": 0.0, "target_modules": modules, "bias": "none", "use_rslora": False,
              "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
