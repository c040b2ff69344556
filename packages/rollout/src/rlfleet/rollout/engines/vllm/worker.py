"""rlfleet's extension of vLLM's worker: in-place weight loads inside each vLLM worker process.

vLLM mixes :class:`RlfleetWorkerExtension` into its worker class (``worker_extension_cls``); the
engine calls its methods by name through ``LLM.collective_rpc``, so every tensor-parallel rank
runs them and shards the full tensors it gets for itself. Across processes the arguments travel
as a safetensors blob (vLLM's RPC would turn raw tensors into lists); in-process the
``(name, tensor)`` pairs are handed over as they are. CUDA IPC buckets (a colocated trainer's
buffers on this GPU) travel as their descriptions and are mapped here, in the worker.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from rlfleet.common.schema.carriers import IpcBucket
from rlfleet.rollout.engines.cuda_ipc import load_and_release
from rlfleet.rollout.engines.vllm.weights import decode_bucket

logger = logging.getLogger(__name__)

# vLLM warns for every layer a reload did not touch; a bucket touches only some by design.
_PARTIAL_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


@contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _PARTIAL_RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


class RlfleetWorkerExtension:
    """Methods added to vLLM's worker; ``self`` is the worker (``model_runner``, ``reload_weights``)."""

    model_runner: Any
    reload_weights: Any

    def rlfleet_load_weights(
        self, payload: bytes | Sequence[tuple[str, torch.Tensor]], refresh_tied_head: bool
    ) -> int:
        """Load whole blocks of HF-named tensors in place; return how many tensors were loaded.

        ``refresh_tied_head``: the embedding of a tied model changed, so the LM head, which
        shares its weight, re-derives whatever it computed from it at load time (on CPU, the
        prepacked GEMM weight; elsewhere nothing).
        """
        items = decode_bucket(payload)
        self._rlfleet_reload(items, refresh_tied_head)
        logger.debug("reloaded %d tensors in place", len(items))
        return len(items)

    def rlfleet_load_ipc(self, buckets: Sequence[dict[str, Any]], refresh_tied_head: bool) -> int:
        """Map CUDA IPC buckets of this worker's GPU and reload their tensors in place, on the device.

        ``buckets`` are :class:`~rlfleet.common.schema.carriers.IpcBucket` dicts (validated again here:
        this is the process that opens the handles). Returns how many tensors were loaded.
        """
        parsed = [IpcBucket.model_validate(b) for b in buckets]
        device = self.model_runner.device
        return load_and_release(parsed, device, lambda items: self._rlfleet_reload(items, refresh_tied_head))

    def _rlfleet_reload(self, items: list[tuple[str, torch.Tensor]], refresh_tied_head: bool) -> None:
        if loads_in_place(self.model_runner):
            self.model_runner.get_model().load_weights(weights=iter(items))  # failing: the engine marks torn
            return
        with _quiet_partial_reload():
            try:
                self.reload_weights(weights_iterator=iter(items))
            except BaseException:
                _abort_layerwise_reload(self.model_runner.get_model())
                raise
        if refresh_tied_head:
            model = self.model_runner.get_model()
            head = getattr(model, "lm_head", None)
            method = getattr(head, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(head)


def loads_in_place(runner: Any) -> bool:
    """Whether a reload may copy straight into the parameters (the model's ``load_weights``): a CUDA
    device, no quantization, no LoRA, and ``RLFLEET_VLLM_LAYERWISE_RELOAD`` not set to 1."""
    if os.environ.get("RLFLEET_VLLM_LAYERWISE_RELOAD") == "1":
        return False
    config = getattr(runner, "vllm_config", None)
    if config is None or torch.device(runner.device).type != "cuda":
        return False
    return config.quant_config is None and config.lora_config is None and not config.model_config.quantization


def _abort_layerwise_reload(model: torch.nn.Module) -> None:
    """Undo the bookkeeping of a reload that broke off, so that the next reload starts clean.

    vLLM's layerwise reload moves each layer onto the meta device, buffers what arrives for it and
    copies the processed values into the layer's original ("kernel") tensors once the layer is
    complete. A reload that raises midway leaves layers half-buffered; the next reload would skip
    their set-up and count the stale buffers as loaded. Here every layer still in progress gets
    its kernel tensors back, untouched (their old values), and its buffers dropped. The engine
    refuses to generate until a full load succeeds (``WeightsTorn``): layers completed before the
    failure hold the new values.
    """
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:  # a vLLM without layerwise reloads keeps no state between reloads
        return
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    aborted = 0
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:  # the meta (or half-built) stand-ins go with their loaders
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
        aborted += 1
    layerwise.LOADING_LAYERS.clear()
    logger.warning("a weight reload broke off: %d layer(s) put back on their previous tensors", aborted)
