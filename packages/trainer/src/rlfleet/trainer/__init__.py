"""Training service for rlfleet: actor/ref/critic, RL losses, weight publishing.

``setup_nccl`` (NCCL environment and collective timeout for trainer ranks) is importable from
here; it is loaded on first use, so ``import rlfleet.trainer`` stays free of torch.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlfleet.trainer.distributed import setup_nccl

__version__ = importlib.metadata.version("rlfleet-trainer")  # written once: pyproject.toml
__all__ = ["__version__", "setup_nccl"]


def __getattr__(name: str) -> Any:
    if name == "setup_nccl":
        from rlfleet.trainer.distributed import setup_nccl

        return setup_nccl
    raise AttributeError(f"module 'rlfleet.trainer' has no attribute {name!r}")
