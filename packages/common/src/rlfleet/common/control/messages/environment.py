"""Environment messages (wire 2.8): multi-turn episodes that a rollout worker drives against an
environment served by reward workers.

An episode: the rollout worker sends :class:`EnvReset` (the dataset item the prompt came from) to
the environment subject; the reward worker that takes it keeps the episode's state and answers an
:class:`EnvObservation` naming itself (``worker_id``). Every later :class:`EnvStep` (the text of
the model's turn) and the final :class:`EnvClose` go to that worker's own subject. Each step's
observation is text the rollout worker appends as a turn (``role``: ``tool`` or ``user``) after
the model's tokens, exactly as it tokenises it, never re-tokenising what came before; the episode
ends when ``done`` (its ``reward`` is the episode's) or at the rollout worker's turn and token
limits. ``info`` holds per-step counts (tool calls, malformed calls, errors) for the step metrics.

Environments are named endpoints of a reward server, with the same tenants, tokens and quotas as
reward endpoints; a server runs only environments its operator configured (nothing in these
messages is code).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfleet.common.control.messages.base import Message

EPISODE_ID = Field(
    min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$", description="unique per episode"
)


class EnvReset(Message):
    """Begin an episode of environment ``env`` from a dataset ``item`` (its prompt, answer, ...)."""

    kind: Literal["env.reset"] = "env.reset"
    env: str = Field(default="default", min_length=1, max_length=128, description="the environment endpoint")
    episode_id: str = EPISODE_ID
    item: dict[str, Any] = Field(default_factory=dict, description="the dataset row the prompt came from")
    seed: int = Field(default=0, ge=0, lt=2**63)
    deadline: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="wall-clock time after which the caller stops waiting",
    )


class EnvStep(Message):
    """The model's turn in an episode: its text (the environment parses tool calls out of it)."""

    kind: Literal["env.step"] = "env.step"
    env: str = Field(default="default", min_length=1, max_length=128)
    episode_id: str = EPISODE_ID
    action: str = Field(max_length=1 << 17, description="the text of the model's turn")
    deadline: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class EnvClose(Message):
    """End an episode (done, or cut at the rollout worker's limits): its state is dropped."""

    kind: Literal["env.close"] = "env.close"
    env: str = Field(default="default", min_length=1, max_length=128)
    episode_id: str = EPISODE_ID


class EnvObservation(Message):
    """What the environment answers a reset or a step with."""

    kind: Literal["env.observation"] = "env.observation"
    episode_id: str = EPISODE_ID
    worker_id: str = Field(default="", max_length=128, description="the reward worker holding the episode")
    observation: str = Field(default="", max_length=1 << 17, description="text to append as the next turn")
    role: Literal["tool", "user"] = Field(default="tool", description="the chat role of the observation turn")
    reward: float = Field(default=0.0, allow_inf_nan=False, description="the episode's reward, once done")
    done: bool = False
    info: dict[str, float] = Field(
        default_factory=dict, description="per-step counts: tool_calls, tool_errors, malformed_calls, ..."
    )
