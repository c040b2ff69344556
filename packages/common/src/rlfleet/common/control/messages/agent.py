"""Agent messages (wire 2.9): episodes that the user's own agent program runs against a rollout
worker's OpenAI-compatible endpoint (issue 33, "bring your own agent").

The controller sends :class:`AgentOpen` to a rollout worker's own subject: the worker starts (or
keeps) its chat-completions endpoint, with the run's bearer token and session limits, and answers
:class:`AgentOpened` with the endpoint's URL. The controller's agents call that URL, each under its
session id; every request's prompt tokens, sampled tokens, logprobs and weight version are recorded
on the worker. Once a group's agents have returned their rewards, :class:`AgentCollect` turns the
recorded sessions into a rollout batch in the worker's TensorStore and drops them; the reply is a
:class:`~rlfleet.common.control.messages.rollout.GenerateResult`, so the batch goes to the reward and
trainer tiers as any generate job's does (bulk data never rides on NATS).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlfleet.common.control.messages.base import Message
from rlfleet.common.control.messages.rollout import SamplingParams, TokenId

SESSION_ID = r"^[A-Za-z0-9_.:-]{1,128}$"
"""What a session id may hold (it names the session in logs and in the endpoint's errors)."""


class AgentOpen(Message):
    """Serve the OpenAI-compatible endpoint for this run's agents (idempotent: a second open with the
    same token keeps the sessions; a new token replaces the old one and drops every session)."""

    kind: Literal["rollout.agent_open"] = "rollout.agent_open"
    token: str = Field(min_length=16, max_length=256, description="the bearer token requests must carry")
    sampling: SamplingParams = Field(
        default_factory=SamplingParams,
        description="the run's sampling (temperature, top_p, top_k; max_tokens caps each request's)",
    )
    max_sessions: int = Field(default=1024, ge=1, le=1 << 16, description="sessions held at once")
    max_session_tokens: int = Field(
        default=8192, ge=1, le=1 << 20, description="a session's tokens (prompt and response) at most"
    )
    idle_s: float = Field(
        default=600.0,
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="a session unused this long is dropped",
    )
    request_timeout_s: float = Field(
        default=120.0, gt=0, le=3600, allow_inf_nan=False, description="one request's generation at most"
    )


class AgentOpened(Message):
    """The endpoint is up: agents call ``url`` (``.../v1``)."""

    kind: Literal["rollout.agent_opened"] = "rollout.agent_opened"
    worker_id: str
    url: str = Field(max_length=1024)


class AgentCollect(Message):
    """Make the batch of a chunk's agent runs: ``sessions`` prompt-major (session ``i*n + j`` is
    sample ``j`` of prompt ``i``, ``n = len(sessions) / len(prompt_token_ids)``), each with the
    reward its agent returned and whether the agent failed (its reward is then 0). A session with no
    request (an agent that failed first) becomes a row of the prompt and one masked token."""

    kind: Literal["rollout.agent_collect"] = "rollout.agent_collect"
    job_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[list[TokenId]] = Field(min_length=1, max_length=1 << 14)
    sessions: list[str] = Field(min_length=1, max_length=1 << 16)
    rewards: list[Annotated[float, Field(allow_inf_nan=False)]] = Field(max_length=1 << 16)
    failed: list[bool] = Field(max_length=1 << 16)

    @model_validator(mode="after")
    def _aligned(self) -> AgentCollect:
        n = len(self.sessions)
        if len(self.rewards) != n or len(self.failed) != n:
            raise ValueError(f"{n} sessions need {n} rewards and {n} failed flags, got "
                             f"{len(self.rewards)} and {len(self.failed)}")  # fmt: skip
        if n % len(self.prompt_token_ids):
            raise ValueError(
                f"{n} sessions are no whole number of samples for {len(self.prompt_token_ids)} prompts"
            )
        bad = [s for s in self.sessions if not re.match(SESSION_ID, s)]
        if bad:
            raise ValueError(f"session id {bad[0][:140]!r} is not 1-128 of A-Z a-z 0-9 _ . : -")
        if len(set(self.sessions)) != n:
            raise ValueError("a session id appears twice")
        return self
