"""``GRPOTrainer``: Group Relative Policy Optimization over the rlfleet tiers, usable as a library.

The step it runs is online RL's (:mod:`rlfleet.controller.online`: generate, score, train,
publish); with ``config.algorithm.name`` set to ``rloo`` or ``reinforce_pp`` the same step trains
those, since only the trainer's advantages differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import DataSource, PromptDataset
from rlfleet.controller.online import OnlineTrainer
from rlfleet.controller.python_reward import reward_of, run_weights
from rlfleet.controller.run import StepResult
from rlfleet.controller.trainer_base import with_held_out

__all__ = ["GRPOTrainer", "StepResult"]


class GRPOTrainer(OnlineTrainer):
    """Group Relative Policy Optimization (and RLOO, REINFORCE++) over the rlfleet tiers.

    ``reward`` is a reward spec string of rlfleet-reward (``"concise:max_words=50 + 0.5*relevance"``,
    ``"my_rewards:score"``) or its dict form, which the run's reward worker serves, or a Python
    callable (``lambda text: ...``, ``fn(prompt, response, **metadata)``, TRL's
    ``fn(prompts, completions, **kw)``, which gets messages for chat prompts), which the controller
    calls itself (:mod:`rlfleet.controller.python_reward`), or a list of either kind (TRL's
    ``reward_funcs``), summed with ``reward_weights`` (or the config's ``reward.weights``; 1 each),
    each one's mean logged as ``reward/<name>``. ``dataset`` is a :class:`PromptDataset`, a path to
    one, a list of dicts or a ``datasets.Dataset``; ``eval_dataset`` too, the held-out prompts of
    ``eval.every`` and the run's before/after evaluation (``eval.data``). ``callbacks``: objects
    with ``on_step_end``, ``on_evaluate`` or ``on_save`` (:mod:`rlfleet.controller.callbacks`).
    """

    def __init__(
        self,
        actor_model_name: str,
        reward: str | dict[str, Any] | Callable[..., Any] | Sequence[Any],
        dataset: PromptDataset | DataSource,
        config: TrainerConfig | None = None,
        *,
        reward_weights: Sequence[float] | None = None,
        callbacks: Iterable[Any] = (),
        eval_dataset: DataSource | None = None,
    ) -> None:
        config = with_held_out(config or TrainerConfig(), eval_dataset)
        reward = reward_of(reward, run_weights(reward_weights, config.reward.weights))
        super().__init__(actor_model_name, reward, dataset, config)
        for callback in callbacks:
            self.add_callback(callback)
