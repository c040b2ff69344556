"""The job's ``environment`` section: multi-turn episodes (issue 33). With an ``env``, each rollout
is an episode the rollout worker drives against that environment of the reward tier (generate a
turn, send it, append the observation, go on; :mod:`rlfleet.rollout.episodes`); the dataset row of
each prompt is the episode's item. ``serve`` has the run's own reward worker serve it (a shared
reward server serves what its operator configured: give ``env`` alone; the rollout workers then
reach that server at ``reward.url`` themselves, their requests carrying the run's ``reward.token``,
and a refusal of the tenant fails the run by name). The episode's reward is
the environment's: a job scores with the ``episode`` reward rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from rlfleet.common.control.messages.rollout import EpisodeSpec
from rlfleet.common.schema.config import ConfigModel


class EnvironmentSettings(ConfigModel):
    """Which environment a run's episodes play, and their limits."""

    env: str = Field(
        default="", max_length=128, pattern=r"^[A-Za-z0-9_.-]*$",
        description="the environment endpoint on the reward servers; empty: single-turn rollouts",
    )  # fmt: skip
    serve: str = Field(
        default="", max_length=4096,
        description="the environment the run's own reward worker serves as env (e.g. calculator, "
        "guess_number:max_turns=6); empty: a shared reward server serves env",
    )  # fmt: skip
    max_turns: int = Field(default=4, ge=1, le=64, description="the model's turns an episode may take")
    max_observation_tokens: int = Field(
        default=256, ge=1, le=1 << 15, description="an observation's tokens beyond this are cut (and counted)"
    )
    timeout_s: float = Field(
        default=30.0, gt=0.0, le=3600.0, allow_inf_nan=False,
        description="how long one environment reset or step may take before the episode ends with reward 0",
    )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return bool(self.env)

    def episodes(self, max_response_length: int, items: Sequence[Mapping[str, Any]]) -> EpisodeSpec:
        """The episodes of prompts whose dataset rows are ``items``: each turn at most
        ``max_response_length`` tokens (the sampling's ``max_tokens``), the whole episode at most
        ``max_turns`` turns and their observations."""
        per_turn = max_response_length + self.max_observation_tokens
        return EpisodeSpec(
            env=self.env,
            items=[dict(item) for item in items],
            max_turns=self.max_turns,
            max_episode_tokens=self.max_turns * per_turn,
            max_observation_tokens=self.max_observation_tokens,
            env_timeout_s=self.timeout_s,
        )
