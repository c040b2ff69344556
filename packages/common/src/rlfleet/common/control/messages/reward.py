"""Reward messages: scoring a rollout batch, swapping an endpoint's reward, the endpoints' statistics."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlfleet.common.control.messages.base import Message
from rlfleet.common.schema.refs import TensorRef


class ScoreRequest(Message):
    """Score a rollout batch with an endpoint's reward spec."""

    kind: Literal["reward.score"] = "reward.score"
    job_id: str
    endpoint: str = "default"
    rollout: TensorRef
    metadata: list[dict[str, Any]] = Field(
        default_factory=list, description="per prompt (group), e.g. answers"
    )
    token: str = Field(
        default="", description="protocol 1.1: the tenant token; now sent in the Rlfleet-Token header"
    )
    deadline: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="wall-clock time (UNIX seconds) after which the requester no longer waits: the server "
        "refuses or stops the work past it (wire 2.5; None: the server's own cap)",
    )  # fmt: skip


class ScoreResult(Message):
    """Scores for every sample of a batch, and each component on its own."""

    kind: Literal["reward.result"] = "reward.result"
    job_id: str
    endpoint: str
    spec_version: str
    scores: list[float] = Field(description="(N,) the rewards: weighted total, then the endpoint's scaler")
    components: dict[str, list[float]] = Field(default_factory=dict)
    raw_scores: list[float] = Field(
        default_factory=list, description="(N,) weighted totals before the endpoint's scaler (empty: none)"
    )


class SetRewardSpec(Message):
    """Replace an endpoint's reward (hot swap): built in the background, then switched atomically.

    ``spec`` is the new spec (the spec syntax of rlfleet-reward, text or dict form); ``model_path``
    instead keeps the endpoint's spec and points its ``rm`` component (the one labelled
    ``component``, when several) at another reward-model directory. ``scaler`` (RewardScaler
    options) replaces the endpoint's scaler and ``scaler_state`` its running statistics; None keeps
    them. ``token`` is the tenant's token (or the server's admin token).
    """

    kind: Literal["reward.set_spec"] = "reward.set_spec"
    endpoint: str = "default"
    spec: str | dict[str, Any] | None = None
    token: str = Field(default="", description="protocol 1.1 only; now the Rlfleet-Token header")
    model_path: str | None = Field(default=None, description="new directory for the endpoint's rm component")
    component: str | None = Field(default=None, description="label of the rm component model_path replaces")
    scaler: dict[str, Any] | None = Field(default=None, description="RewardScaler options; {} = no scaling")
    scaler_state: dict[str, Any] | None = Field(default=None, description="RewardScaler.state_dict()")


class RewardSpecSet(Message):
    """An endpoint switched to a new spec."""

    kind: Literal["reward.spec_set"] = "reward.spec_set"
    endpoint: str
    spec_version: str
    previous_version: str = ""
    spec: str = Field(default="", description="the new spec in text form")
    load_s: float = Field(default=0.0, description="seconds spent building the new reward")


class RewardStatsRequest(Message):
    """Ask a reward worker for the statistics of the endpoints the token may see."""

    kind: Literal["reward.stats"] = "reward.stats"
    token: str = Field(default="", description="protocol 1.1 only; now the Rlfleet-Token header")
    endpoint: str = Field(default="", description="one endpoint; empty: every endpoint the token may see")


class EndpointStats(BaseModel):
    """What a reward worker knows about one endpoint."""

    model_config = ConfigDict(extra="ignore")

    spec: str
    spec_version: str
    requests: int = 0
    samples: int = 0
    errors: int = 0
    raw_mean: float = Field(default=0.0, description="mean weighted total (before scaling) of every sample")
    scaler: dict[str, Any] | None = None
    scaler_state: dict[str, Any] | None = None


class RewardStats(Message):
    """Per-endpoint statistics, limited to what the asking token may see."""

    kind: Literal["reward.stats_result"] = "reward.stats_result"
    worker_id: str
    tenant: str = Field(default="", description="the tenant the token belongs to ('admin' / '' when open)")
    endpoints: dict[str, EndpointStats] = Field(default_factory=dict)
    refused: dict[str, int] = Field(default_factory=dict, description="this tenant's refusals, by error code")
