"""Loading Hugging Face models for reward components: device choice, offline loading, a shared cache.

Models load from local directories (``local_files_only``); a Hugging Face Hub id (``org/name``,
``org/name@revision``) names its snapshot in the local Hugging Face cache, fetched first unless
``HF_HUB_OFFLINE`` is set (:mod:`rlfleet.common.hub`). Whether a model may run the Python code its
folder ships is the worker's own ``loading.trust_remote_code`` (:func:`allow_remote_code`, set once at
start), never a tenant's spec.
Loaded models are shared: components (or endpoints) naming the same directory, device and dtype
hold one copy, and the copy goes once the last reward using it is dropped, so a hot swap to
another model frees the old one. The cache key includes the size and mtime of every file in the
directory: a directory whose weights were overwritten loads again.

torch and transformers are imported inside the functions, so a server with rule rewards only
never imports them; they come with the ``models`` extra (``pip install 'rlfleet-reward[models]'``), and
a model asked for without it is refused with a :class:`RewardModelError` that names the extra
(:func:`require_models_extra`).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlfleet.common.errors import HubModelNotFound
from rlfleet.common.hub import resolve_hub_model, split_hub_id
from rlfleet.common.remote_code import refused_remote_code, remote_code_reason
from rlfleet.reward.errors import RewardModelError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]

CacheKey = tuple[str, str, str, str, tuple[tuple[str, int, int], ...]]

MODELS_EXTRA = "rlfleet-reward[models]"
"""The extra that brings what reward models and sentence encoders run on (torch, transformers)."""


@dataclass(eq=False)
class LoadedModel:
    """A model and its tokenizer on one device; ``lock`` serializes forward passes on it."""

    model: Any
    tokenizer: Any
    device: torch.device
    path: Path
    lock: threading.Lock = field(default_factory=threading.Lock)


_REMOTE_CODE = threading.Event()
"""Set: reward models may run the code their folders ship (the worker's ``loading.trust_remote_code``)."""
_CACHE: weakref.WeakValueDictionary[CacheKey, LoadedModel] = weakref.WeakValueDictionary()
_CACHE_LOCK = threading.Lock()


def resolve_device(device: str) -> torch.device:
    """``"auto"``: the first CUDA GPU when there is one, else the CPU; otherwise ``torch.device(device)``."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise RewardModelError(device, f"bad device {device!r}: {exc}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RewardModelError(device, "device 'cuda' asked for, but torch sees no CUDA GPU")
    return resolved


def resolve_dtype(dtype: DtypeName, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on a GPU, float32 on the CPU."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def allow_remote_code(enabled: bool) -> None:
    """The worker's ``loading.trust_remote_code``: whether loaders pass it to ``from_pretrained``."""
    if enabled:
        _REMOTE_CODE.set()
    else:
        _REMOTE_CODE.clear()


def remote_code_allowed() -> bool:
    """What loaders pass as ``trust_remote_code`` (see :func:`allow_remote_code`)."""
    return _REMOTE_CODE.is_set()


def require_models_extra(path: str) -> None:
    """Refuse the model at ``path`` by name when torch or transformers is not installed (a server of
    rule rewards is installed without them)."""
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        reason = (f"reward models need {' and '.join(missing)}, which this install lacks: "
                  f"pip install '{MODELS_EXTRA}'")  # fmt: skip
        raise RewardModelError(path, reason)


def model_dir(path: str) -> Path:
    """``path`` as an existing local model directory (one holding ``config.json``), or the local
    snapshot of the Hub model it names."""
    folder = Path(path).expanduser()
    if not folder.exists() and split_hub_id(path) is not None and not path.startswith(("~", ".")):
        try:
            return resolve_hub_model(path)
        except HubModelNotFound as exc:
            raise RewardModelError(path, f"no such directory; as a Hub id: {exc.reason}") from exc
    if not folder.is_dir():
        raise RewardModelError(path, "no such directory (and not a Hugging Face Hub id 'org/name')")
    if not (folder / "config.json").is_file():
        raise RewardModelError(path, "the directory holds no config.json; is it a Hugging Face model?")
    return folder.resolve()


def fingerprint(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """``(name, size, mtime_ns)`` of every file directly in ``folder``, sorted."""
    entries = []
    for item in sorted(folder.iterdir()):
        if item.is_file():
            stat = item.stat()
            entries.append((item.name, stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


def load_shared(
    kind: str,
    path: str,
    device: str,
    dtype: DtypeName,
    loader: Callable[[Path, torch.device, torch.dtype], tuple[Any, Any]],
) -> LoadedModel:
    """The cached model of ``kind`` at ``path``, loading it with ``loader(folder, device, dtype)``.

    ``loader`` returns ``(model, tokenizer)``; the model is put in eval mode. Failures of the
    loader become :class:`RewardModelError` naming the directory.
    """
    require_models_extra(path)
    folder = model_dir(path)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    key: CacheKey = (kind, str(folder), str(torch_device), str(torch_dtype), fingerprint(folder))
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
        if cached is not None:
            logger.debug("reusing loaded %s model %s on %s", kind, folder, torch_device)
            return cached
        start = time.perf_counter()
        try:
            model, tokenizer = loader(folder, torch_device, torch_dtype)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            if refused_remote_code(exc):
                raise RewardModelError(str(folder), remote_code_reason(folder)) from None
            raise RewardModelError(str(folder), f"{type(exc).__name__}: {exc}") from exc
        model.eval()
        loaded = LoadedModel(model=model, tokenizer=tokenizer, device=torch_device, path=folder)
        _CACHE[key] = loaded
    logger.info("loaded %s model %s on %s (%s) in %.1fs", kind, folder, torch_device, torch_dtype,
                time.perf_counter() - start)  # fmt: skip
    return loaded


def loaded_count() -> int:
    """How many models the cache holds right now (for tests and stats)."""
    with _CACHE_LOCK:
        return len(_CACHE)
