"""Loading, freezing, seeding and saving HF causal LMs from local directories (no hub access)."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx.experimental import _config as shape_config
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlfleet.common.remote_code import refused_remote_code, remote_code_reason
from rlfleet.trainer.errors import ModelLoadError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files :func:`save_hf` copies from the source model directory when they exist there."""


def set_seed(seed: int) -> None:
    """Seed Python's and torch's generators (CPU and every CUDA device)."""
    random.seed(seed)
    torch.manual_seed(seed)


def load_pretrained(
    auto_class: Any, path: str | Path, *, dtype: torch.dtype, attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:  # fmt: skip
    """``auto_class.from_pretrained`` of a local directory (no hub), in ``dtype``, on the CPU;
    ``trust_remote_code`` lets it run modeling code the folder ships (``ModelSettings``).

    Raises:
        ModelLoadError: the directory does not exist or has no ``config.json``, or its code is refused.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(str(path), "no config.json there (expected a save_pretrained directory)")
    kwargs: dict[str, object] = {"dtype": dtype, "local_files_only": True}
    kwargs["trust_remote_code"] = trust_remote_code
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        return auto_class.from_pretrained(str(path), **kwargs)
    except ValueError as exc:
        if refused_remote_code(exc):
            raise ModelLoadError(str(path), remote_code_reason(path)) from None
        raise


def load_causal_lm(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load an HF causal LM from a local directory, in ``dtype`` on ``device``, in eval mode.

    Raises:
        ModelLoadError: the directory does not exist or has no ``config.json``.
    """
    model = load_pretrained(AutoModelForCausalLM, path, dtype=dtype, attn_implementation=attn_implementation,
                            trust_remote_code=trust_remote_code)  # fmt: skip
    model.to(device)
    model.eval()
    logger.info("loaded %s (%s, %s) from %s", type(model).__name__, dtype, device, path)
    return model


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode and no gradients for every parameter (a reference model); returns ``model``."""
    model.eval()
    model.requires_grad_(False)
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of an HF causal LM (``model.model.layers`` and the like) or of the
    critic's value model (``backbone.layers``)."""
    for path in (
        "model.layers",
        "model.decoder.layers",
        "transformer.h",
        "gpt_neox.layers",
        "backbone.layers",
    ):
        module: object = model
        for part in path.split("."):
            module = getattr(module, part, None)
        if isinstance(module, nn.ModuleList):
            return module
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to freeze")


BLOCK_VARIANTS = 32
"""The recompiles a compiled block's forward may take (torch's default is 8; see :func:`compile_blocks`)."""


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` each decoder block's forward in place (one graph, reused by every block).

    The blocks' module hooks (FSDP's all-gathers) stay outside the compiled code, and the
    parameter names do not change. The first forwards are slow while the graph compiles.

    Shapes are dynamic from the first compile (``dynamic=True``): a micro-batch's row count and
    sequence length are symbols in the graph, so a step of new lengths reuses it. (Compiled for the
    first shape it met, as by default, a block compiled again when the sequence length first changed
    and again when the row count did; a GPU run recompiled at steps 2, 4 and 7, 2.4 to 12.5 s each.)
    The hidden and head sizes end up constants: they meet the parameters' shapes, which stay
    static. Two more torch settings, set for the whole process as the limit below is: sizes that
    happen to be equal do not share a symbol (``use_duck_shape``; sharing one, a batch of as many
    rows as the head size had its rows fixed with the head size), and float attributes (norm
    epsilon, attention scale) are constants (``specialize_float``), which spares tracing each block
    twice.

    One graph serves several variants, each compiled once: grad on (the policy) and off (the
    reference, old logprobs), the first block's input without grad and the others' with it, an
    attention mask or none (no row padded), a micro-batch of one row (torch fixes sizes 0 and 1),
    and for LoRA the adapters on and off (the reference is the base with them off). They outnumber
    torch's default of 8 recompiles per function, past which it runs the rest eagerly (a LoRA 1.5B
    run hit it: 0.71x the full model's tokens/s); the limit is raised to :data:`BLOCK_VARIANTS`.
    """
    limit = max(getattr(torch._dynamo.config, "recompile_limit", 8), BLOCK_VARIANTS)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.specialize_float = True
    shape_config.use_duck_shape = False
    for block in decoder_layers(model):
        block.forward = torch.compile(block.forward, dynamic=True)  # type: ignore[method-assign]


def train_top_layers(model: nn.Module, num_layers: int) -> list[str]:
    """Freeze everything but the top ``num_layers`` blocks and the final norm; returns trainable names.

    Embeddings (and a tied lm_head) stay frozen. Backward then stops at the lowest trainable
    block, which is what makes partial fine-tuning cheap on CPU.
    """
    layers = decoder_layers(model)
    if not 0 < num_layers <= len(layers):
        raise ValueError(f"trainable_layers must be in 1..{len(layers)} for this model; got {num_layers}")
    model.requires_grad_(False)
    for block in list(layers)[-num_layers:]:
        block.requires_grad_(True)
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if isinstance(norm, nn.Module):
        norm.requires_grad_(True)
    return [name for name, p in model.named_parameters() if p.requires_grad]


def disable_dropout(model: nn.Module) -> None:
    """Zero every dropout in ``model``: RL ratios need train-mode and eval-mode forwards to agree.

    Covers ``nn.Dropout`` modules and the float ``attention_dropout`` attribute HF attention
    layers read in train mode.
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def save_hf(
    model: PreTrainedModel,
    path: str | Path,
    *,
    source_dir: str | Path | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save ``model`` as safetensors with its config, plus the tokenizer files of ``source_dir``.

    Args:
        model: the model to save (its current dtype).
        path: target directory, created if needed.
        source_dir: the directory the model was loaded from; its tokenizer files
            (:data:`TOKENIZER_FILES`) are copied when present.
        state_dict: the full weights to write instead of ``model.state_dict()`` (an FSDP model's
            gathered weights).

    Returns:
        the target directory.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), state_dict=state_dict)
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(source_dir) / name
            if src.is_file():
                shutil.copy2(src, path / name)
    logger.info("saved %s to %s", type(model).__name__, path)
    return path
