"""The rlfleet single controller: datasets, GRPO/PPO/DPO trainers, embedded launcher, CLI.

The public API is importable from here (``from rlfleet.controller import GRPOTrainer``); each name
is loaded on first use, so importing the package (and ``rlfleet --help``) stays free of torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

__version__ = importlib.metadata.version("rlfleet-controller")  # written once: pyproject.toml

# public name -> the module defining it
_EXPORTS: dict[str, str] = {
    "GRPOTrainer": "rlfleet.controller.grpo",
    "PPOTrainer": "rlfleet.controller.ppo",
    "DPOTrainer": "rlfleet.controller.dpo",
    "StepResult": "rlfleet.controller.run",
    "TrainerConfig": "rlfleet.controller.config",
    "JobConfig": "rlfleet.controller.config",
    "PromptDataset": "rlfleet.controller.dataset",
    "PreferenceDataset": "rlfleet.controller.preference",
    "resolve_model": "rlfleet.controller.models",
    "Pool": "rlfleet.controller.routing",
    "Response": "rlfleet.controller.routing",
    "TrainerCallback": "rlfleet.controller.callbacks",
}

__all__ = [
    "DPOTrainer",
    "GRPOTrainer",
    "JobConfig",
    "PPOTrainer",
    "Pool",
    "PreferenceDataset",
    "PromptDataset",
    "Response",
    "StepResult",
    "TrainerCallback",
    "TrainerConfig",
    "__version__",
    "resolve_model",
]

if TYPE_CHECKING:
    from rlfleet.controller.callbacks import TrainerCallback
    from rlfleet.controller.config import JobConfig, TrainerConfig
    from rlfleet.controller.dataset import PromptDataset
    from rlfleet.controller.dpo import DPOTrainer
    from rlfleet.controller.grpo import GRPOTrainer
    from rlfleet.controller.models import resolve_model
    from rlfleet.controller.ppo import PPOTrainer
    from rlfleet.controller.preference import PreferenceDataset
    from rlfleet.controller.routing import Pool, Response
    from rlfleet.controller.run import StepResult


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlfleet.controller' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
