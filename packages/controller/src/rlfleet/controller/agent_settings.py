"""The job's ``agent`` section: bring your own agent (issue 33, point 4).

With a ``function``, every rollout of the run is an episode the user's agent program runs against a
rollout worker's OpenAI-compatible endpoint (:mod:`rlfleet.rollout.openai_endpoint`): the
controller calls ``function(base_url, api_key, session_id, item)`` once per sample (``item``: the
prompt's dataset row, its prompt under ``prompt``), sync or async, and the agent returns its reward.
The trainer trains on exactly the tokens the endpoint recorded for the session; a job scores with
the ``episode`` reward rule (the agent's reward). :mod:`rlfleet.controller.agent_rollout` runs them.
"""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.schema.config import ConfigModel


class AgentSettings(ConfigModel):
    """Which agent runs the run's episodes, and its limits."""

    function: str = Field(
        default="", max_length=512,
        description="the agent, 'package.module:function' (found as a rollout_fn is); empty: no agent "
        "(a library user may set a callable with trainer.set_agent)",
    )  # fmt: skip
    agent_timeout_s: float = Field(
        default=300.0, gt=0.0, le=86400.0, allow_inf_nan=False,
        description="one agent run at most; past it the sample's reward is 0 (counted, logged)",
    )  # fmt: skip
    max_parallel: int = Field(default=64, ge=1, le=4096, description="agent runs at once, per chunk")
    max_session_tokens: int = Field(
        default=4096, ge=16, le=1 << 20, description="a session's tokens (prompt and every turn) at most"
    )
    session_idle_s: float = Field(
        default=900.0, gt=0.0, le=86400.0, allow_inf_nan=False,
        description="a session the agent left unused this long is dropped by the rollout worker",
    )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return bool(self.function)
