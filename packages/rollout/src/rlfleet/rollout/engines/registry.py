"""Engines by config name: a plain dict keyed by the ``engine`` discriminator, and one factory.

``"vllm"`` is registered as a small factory that imports :mod:`rlfleet.rollout.engines.vllm`
(and with it vLLM, 8 s) only when that engine is built, so importing ``rlfleet.rollout`` never
imports vLLM. ``"auto"`` in configs resolves with :func:`resolve_engine_name`.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.rollout.engines.base import Engine
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.rollout.errors import UnknownEngine

logger = logging.getLogger(__name__)


def _vllm_engine(model_path: str | Path, **kwargs: Any) -> Engine:
    from rlfleet.rollout.engines.vllm import VLLMEngine

    engine: Engine = VLLMEngine(model_path, **kwargs)
    return engine


ENGINES: dict[str, Callable[..., Engine]] = {"hf": HFEngine, "vllm": _vllm_engine}
"""Engine constructors by name; each is called as ``ENGINES[name](model_path, **kwargs)``."""


def vllm_available() -> bool:
    """Whether the ``vllm`` package is installed (``--extra cpu`` or ``--extra gpu``); nothing is imported."""
    return importlib.util.find_spec("vllm") is not None


def resolve_engine_name(name: str) -> str:
    """``"auto"`` -> ``"vllm"`` when vLLM is installed, else ``"hf"``; other names unchanged."""
    if name != "auto":
        return name
    return "vllm" if vllm_available() else "hf"


def make_engine(name: str, model_path: str | Path, **kwargs: Any) -> Engine:
    """Build the engine registered as ``name`` (or ``"auto"``) for the checkpoint at ``model_path``."""
    resolved = resolve_engine_name(name)
    try:
        factory = ENGINES[resolved]
    except KeyError:
        raise UnknownEngine(name, sorted(ENGINES)) from None
    logger.info("starting %s engine for %s", resolved, model_path)
    engine: Engine = factory(model_path, **kwargs)
    return engine
