"""Engines by config name: a plain dict keyed by the ``engine`` discriminator, and one factory.

"vllm" joins once its engine exists; until then asking for it raises :class:`UnknownEngine`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rlfleet.rollout.engines.base import Engine
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.rollout.errors import UnknownEngine

logger = logging.getLogger(__name__)

ENGINES: dict[str, type] = {"hf": HFEngine}
"""Engine classes by name; each is constructed as ``cls(model_path, **kwargs)``."""


def make_engine(name: str, model_path: str | Path, **kwargs: Any) -> Engine:
    """Build the engine registered as ``name`` for the checkpoint at ``model_path``."""
    try:
        cls = ENGINES[name]
    except KeyError:
        raise UnknownEngine(name, sorted(ENGINES)) from None
    logger.info("starting %s engine for %s", name, model_path)
    engine: Engine = cls(model_path, **kwargs)
    return engine
