"""LoRA adapters for the engine tests, made as PEFT saves them (``base_model.model.<layer>.lora_A.weight``,
rank x in, and ``lora_B``, out x rank), and the models expected to serve them: the base with
``W + (alpha / rank) B A`` written into each adapted layer, computed apart from the engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlfleet.common.schema.trainer import LoraSettings

RANK, ALPHA = 4, 8.0
SETTINGS = LoraSettings(rank=RANK, alpha=ALPHA, target_modules=["q_proj", "v_proj", "down_proj"])


def make_adapter(path: Path, targets: Sequence[str], seed: int, rank: int = RANK) -> dict[str, torch.Tensor]:
    """A trained-looking adapter for the model at ``path`` (both halves random, B non-zero)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            stem = f"base_model.model.{name}"
            out[f"{stem}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.3
            out[f"{stem}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.3
    return out


def adapted_model(path: Path, adapter: dict[str, torch.Tensor], alpha: float = ALPHA) -> torch.nn.Module:
    """The base at ``path`` with ``adapter`` merged by hand: what an engine serving it must compute."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, a in adapter.items():
            if name.endswith(".lora_A.weight"):
                layer = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = adapter[name.replace("lora_A", "lora_B")]
                state[f"{layer}.weight"] += (alpha / a.shape[0]) * (b @ a)
    return model


def teacher_forced(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``log p(token_t)`` under ``model`` for the generated ``tokens`` after ``prompt``."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
