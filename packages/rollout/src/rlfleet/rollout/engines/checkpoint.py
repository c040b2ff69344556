"""What an engine needs to know about an HF checkpoint without loading its model.

:func:`read_checkpoint` reads the config, the generation config, the tokenizer and the
safetensors headers (names, shapes, dtypes; no tensor data) of a local HF model directory. The
vLLM engine uses it for the same stop / pad / tokenizer conventions as the HF engine and to
validate weight buckets by HF name before they reach vLLM's workers.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from rlfleet.common.errors import ConfigError

logger = logging.getLogger(__name__)

HEAD_NAME = "lm_head.weight"
"""The HF name of the output projection in every causal-LM family rlfleet serves."""


@dataclass(frozen=True)
class CheckpointInfo:
    """Facts about one checkpoint directory.

    ``weights`` maps each HF tensor name stored in the checkpoint to a meta tensor of its shape
    and dtype. ``tied`` is true when the config ties the LM head to the input embedding, whose
    name is ``embed_name`` (the checkpoint then usually stores only the embedding).
    """

    path: Path
    tokenizer: Any
    eos_ids: tuple[int, ...]
    pad_id: int
    vocab_size: int
    max_positions: int | None
    tied: bool
    embed_name: str | None
    weights: dict[str, torch.Tensor]
    config: Any = None
    """The HF config (the text config of a multimodal one)."""


def load_tokenizer(model_path: str | Path, *, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer, left padding, pad token = EOS when it had none (every engine's)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def read_checkpoint(model_path: str | Path, *, trust_remote_code: bool = False) -> CheckpointInfo:
    """Read ``model_path`` (an HF model directory) into a :class:`CheckpointInfo`; ``trust_remote_code``
    lets its config and tokenizer run the code the folder ships."""
    path = Path(model_path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config()
    generation = _generation_config(path)
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    gen_eos = generation.eos_token_id if generation else None
    gen_pad = generation.pad_token_id if generation else None
    eos = _ids(tokenizer.eos_token_id, gen_eos, config.eos_token_id)
    pad = _first_int(tokenizer.pad_token_id, gen_pad, config.pad_token_id)
    if pad is None:
        raise ConfigError("tokenizer.pad_token", None, "the checkpoint has neither a pad nor an EOS token")
    weights = read_weight_specs(path)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = next((n for n in weights if n.endswith("embed_tokens.weight")), None)
    return CheckpointInfo(
        path=path,
        tokenizer=tokenizer,
        eos_ids=tuple(eos),
        pad_id=pad,
        vocab_size=int(config.vocab_size),
        max_positions=getattr(config, "max_position_embeddings", None),
        tied=tied and embed is not None,
        embed_name=embed,
        weights=weights,
        config=config,
    )


def read_weight_specs(path: Path) -> dict[str, torch.Tensor]:
    """``{hf_name: meta tensor}`` from the headers of every ``*.safetensors`` file (no data read)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ConfigError("model_path", str(path), "holds no *.safetensors weights")
    specs: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                dtype = _DTYPES.get(piece.get_dtype(), torch.float32)
                specs[key] = torch.empty(piece.get_shape(), dtype=dtype, device="meta")
    return specs


_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _generation_config(path: Path) -> GenerationConfig | None:
    if not (path / "generation_config.json").is_file():
        return None
    return GenerationConfig.from_pretrained(path)


def _ids(*sources: object) -> list[int]:
    """EOS ids from every source (tokenizer, generation config, model config), which may list several."""
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return sorted(ids)


def _first_int(*candidates: object) -> int | None:
    return next((c for c in candidates if isinstance(c, int)), None)
