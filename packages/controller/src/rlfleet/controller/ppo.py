"""``PPOTrainer``: PPO with a critic over the rlfleet tiers, usable as a library.

The controller's step is online RL's (generate, score, train, publish); the trainer does the PPO part:
reference and critic passes, the KL in the token rewards, GAE, then critic and policy steps.
A reward model path becomes an ``rm`` component on the reward tier (``rm:path=...``, a
sequence-classification model scoring each sample); any reward spec works as well::

    trainer = PPOTrainer(
        actor_model_name="smollm2",
        reward_model_name="/models/my-rm",           # or reward="charset:allowed=0123456789"
        dataset="prompts.jsonl",
        config=TrainerConfig(rollout_batch_size=64, train_batch_size=32, rollout={"workers": 4},
                             num_train_workers=2, kl_coef=0.1),
    )
    trainer.train(num_epochs=3)

The critic starts from the actor's checkpoint unless ``critic_model_name`` (argument or config
field) names another model; only the actor's weights are published to the rollout tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from rlfleet.common.schema.algorithms import ALGORITHMS
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import DataSource, PromptDataset
from rlfleet.controller.online import OnlineTrainer
from rlfleet.controller.python_reward import reward_of, run_weights
from rlfleet.controller.trainer_base import with_held_out


def reward_model_spec(reward_model_name: str | None, reward: Any) -> Any:
    """The reward of a PPO run: ``reward`` as given (a spec or a Python callable, as GRPOTrainer
    takes), or an ``rm`` component for a model path.

    Exactly one of the two must be given. A path that exists here is made absolute (the reward
    worker may run in another directory); any other is passed on for the reward tier to resolve.
    """
    if (reward_model_name is None) == (reward is None):
        raise ValueError(
            "give exactly one of reward_model_name (a reward model path) and reward (a reward spec)"
        )
    if reward is not None:
        return reward
    assert reward_model_name is not None
    path = Path(reward_model_name).expanduser()
    location = str(path.resolve()) if path.exists() else reward_model_name
    return {"components": [{"name": "rm", "args": {"path": location}}]}


def ppo_config(config: TrainerConfig) -> TrainerConfig:
    """``config`` with an algorithm that trains a critic (``ppo`` unless it names another); an
    explicitly different algorithm is a mistake."""
    name = config.algorithm.name
    if ALGORITHMS[name].needs_critic:
        return config
    if "name" in config.algorithm.model_fields_set:
        raise ValueError(
            f"PPOTrainer trains ppo but the config sets algorithm={name!r}; use GRPOTrainer for "
            "grpo, rloo and reinforce_pp, DPOTrainer for dpo"
        )
    algorithm = {**config.algorithm.model_dump(exclude_unset=True), "name": "ppo"}  # its other settings kept
    return type(config).model_validate({**dict(config), "algorithm": algorithm})


class PPOTrainer(OnlineTrainer):
    """Proximal Policy Optimization with a critic (value model), GAE and a KL-penalised reward."""

    def __init__(
        self,
        actor_model_name: str,
        reward_model_name: str | None = None,
        dataset: PromptDataset | DataSource | None = None,
        config: TrainerConfig | None = None,
        *,
        reward: str | dict[str, Any] | Callable[..., Any] | Sequence[Any] | None = None,
        critic_model_name: str | None = None,
        reward_weights: Sequence[float] | None = None,
        callbacks: Iterable[Any] = (),
        eval_dataset: DataSource | None = None,
    ) -> None:
        if dataset is None:
            raise ValueError(
                "PPOTrainer needs a dataset: a PromptDataset, a path to a prompt file, a list of dicts or a "
                "datasets.Dataset"
            )
        config = with_held_out(ppo_config(config or TrainerConfig()), eval_dataset)
        spec = reward_of(reward_model_spec(reward_model_name, reward),
                         run_weights(reward_weights, config.reward.weights))  # fmt: skip
        super().__init__(actor_model_name, spec, dataset, config, critic_model_name)
        for callback in callbacks:
            self.add_callback(callback)

    @property
    def critic_model_path(self) -> Path:
        """The critic's backbone: ``critic_model_name`` (argument or config field), else the actor's."""
        return self.fleet_run.critic_path
