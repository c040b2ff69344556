"""``GRPOTrainer``: Group Relative Policy Optimization over the rlfleet tiers, usable as a library.

The step it runs is online RL's (:mod:`rlfleet.controller.online`: generate, score, train,
publish); with ``config.algorithm.name`` set to ``rloo`` or ``reinforce_pp`` the same step trains
those, since only the trainer's advantages differ.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import PromptDataset
from rlfleet.controller.online import OnlineTrainer
from rlfleet.controller.run import StepResult

__all__ = ["GRPOTrainer", "StepResult"]


class GRPOTrainer(OnlineTrainer):
    """Group Relative Policy Optimization (and RLOO, REINFORCE++) over the rlfleet tiers.

    ``reward`` is a reward spec string of rlfleet-reward (``"concise:max_words=50 + 0.5*relevance"``,
    ``"my_rewards:score"``) or its dict form, which the run's reward worker serves, or a Python
    callable (``lambda text: ...``, ``fn(prompt, response, **metadata)``, TRL's
    ``fn(prompts, completions, **kw)``), which the controller calls itself
    (:mod:`rlfleet.controller.python_reward`). ``dataset`` is a :class:`PromptDataset` or a path to one.
    """

    def __init__(
        self,
        actor_model_name: str,
        reward: str | dict[str, Any] | Callable[..., Any],
        dataset: PromptDataset | str | Path,
        config: TrainerConfig | None = None,
    ) -> None:
        super().__init__(actor_model_name, reward, dataset, config or TrainerConfig())
