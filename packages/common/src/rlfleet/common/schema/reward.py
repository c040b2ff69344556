"""The reward tier's settings: a reward worker's (or shared reward server's) endpoints, scalers and tenants.

:class:`RewardWorkerConfig` is what ``rlfleet-reward serve --config`` reads (``deploy/reward.yaml``
is one); :class:`EndpointConfig` (a reward spec and an optional :class:`ScalerConfig`) is also
what a run sends when it creates or swaps an endpoint. Torch-free.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfleet.common.schema.worker import ModelLoading, ServiceConfig

Spec = str | dict[str, Any]
"""A reward spec: text (``'0.7*rm:path=/m + 0.3*concise'``) or its dict form."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def token_digest(token: str) -> bytes:
    """SHA-256 of a token: what is compared, so every comparison has the same length."""
    return hashlib.sha256(token.encode()).digest()


class ScalerConfig(BaseModel):
    """The options of a :class:`RewardScaler`."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model_name: str | None = Field(default=None, description="reward model the scores come from, if any")
    temperature: float = Field(
        default=1.0, gt=0, allow_inf_nan=False, description="raw scores are divided by it"
    )
    min_reward: float | None = Field(default=None, allow_inf_nan=False, description="floor applied last")
    clip: float | None = Field(default=None, gt=0, allow_inf_nan=False, description="clip to [-clip, clip]")
    normalize: bool = Field(default=False, description="running mean/std normalization")
    eps: float = Field(default=1e-6, gt=0, allow_inf_nan=False, description="added to std before dividing")

    @model_validator(mode="after")
    def _floor_below_clip(self) -> ScalerConfig:
        if self.clip is not None and self.min_reward is not None and self.min_reward > self.clip:
            raise ValueError(
                f"min_reward ({self.min_reward}) above clip ({self.clip}) would make every reward equal"
            )
        return self


class EndpointConfig(BaseModel):
    """One endpoint of a reward server: its reward spec and, optionally, a scaler."""

    model_config = ConfigDict(extra="forbid")

    spec: Spec = Field(description="reward spec (text or dict form), e.g. '0.7*rm:path=/m + 0.3*concise'")
    scaler: ScalerConfig | None = Field(default=None, description="RewardScaler options applied to totals")


class TokenSource(BaseModel):
    """Exactly one of ``token``, ``token_sha256`` or ``token_env``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token: str | None = Field(default=None, min_length=8, description="the API token (plain text)")
    token_sha256: str | None = Field(default=None, description="hex SHA-256 of the token")
    token_env: str | None = Field(default=None, min_length=1, description="environment variable holding it")

    @model_validator(mode="after")
    def _exactly_one(self) -> TokenSource:
        given = [name for name in ("token", "token_sha256", "token_env") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of token, token_sha256, token_env (got {given or 'none'})")
        if self.token_sha256 is not None and not _HEX64.match(self.token_sha256):
            raise ValueError("token_sha256 must be 64 lowercase hex digits (sha256sum of the token)")
        return self

    def digest(self, who: str) -> bytes:
        """The token's SHA-256, reading ``token_env`` now; ValueError if that variable is unset."""
        if self.token is not None:
            return token_digest(self.token)
        if self.token_sha256 is not None:
            return bytes.fromhex(self.token_sha256)
        assert self.token_env is not None
        value = os.environ.get(self.token_env, "")
        if len(value) < 8:
            raise ValueError(
                f"{who}: environment variable {self.token_env} is unset or shorter than 8 characters"
            )
        return token_digest(value)


class TenantConfig(TokenSource):
    """One tenant of the reward server."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="tenant name (logs, stats)")
    endpoints: list[str] = Field(default_factory=list, description="endpoints this tenant may use")
    requests_per_s: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="requests per second, of every kind (score, set spec, stats); None: no cap",
    )  # fmt: skip
    burst: int | None = Field(default=None, ge=1, description="requests allowed at once; None: max(1, rate)")
    max_batch: int | None = Field(default=None, ge=1, description="samples per request; None: no cap")
    concurrency: int | None = Field(
        default=None, ge=1,
        description="this tenant's requests handled at once; None: the server's max_concurrency / tenants",
    )  # fmt: skip
    stores: list[str] = Field(
        default_factory=list,
        description="TensorStore addresses (host:port globs, e.g. '10.0.1.*:*') its requests may name; "
        "empty: any",
    )
    can_update: bool = Field(
        default=False, description="may hot-swap the reward of its own endpoints (rule specs only)"
    )


class RewardWorkerConfig(ServiceConfig):
    """Settings of a reward worker (and of a shared reward server: tenants, admin token, state)."""

    FLAT_SECTIONS: ClassVar[frozenset[str]] = ServiceConfig.FLAT_SECTIONS | {"loading"}

    loading: ModelLoading = Field(
        default_factory=ModelLoading, description="what loading a reward model may run"
    )
    endpoints: dict[str, EndpointConfig] = Field(
        default_factory=lambda: {"default": EndpointConfig(spec="concise:max_words=50")},
        description="endpoint name -> {spec, scaler}; a bare spec (text or dict form) means {spec: ...}",
    )
    tenants: list[TenantConfig] = Field(
        default_factory=list, description="who may use which endpoints; none: open"
    )
    admin: TokenSource | None = Field(
        default=None, description="the operators' token (token / token_sha256 / token_env)"
    )
    max_concurrency: int = Field(default=4, ge=1, description="score requests handled at once")
    allowed_modules: list[str] = Field(
        default_factory=list,
        description="modules whose functions a tenant's spec may name ('module:function'); "
        "empty: tenants may use built-in rules only",
    )
    quota_store: Literal["nats", "process"] = Field(
        default="nats",
        description="where tenants' requests_per_s quotas are counted: 'nats', a JetStream key-value bucket "
        "(rlfleet-quotas-<cluster>) that every replica of the server shares, so the quotas hold across "
        "replicas (the NATS server needs JetStream); 'process', each replica alone (N replicas give a "
        "tenant N times its rate: for a single replica only)",
    )
    state_dir: str | None = Field(default=None, description="keep endpoint specs and scaler statistics here")
    state_save_s: float = Field(default=30.0, gt=0, description="seconds between saves of the state")

    @field_validator("endpoints", mode="before")
    @classmethod
    def _bare_specs(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        return {
            name: {"spec": cfg}
            if isinstance(cfg, str) or (isinstance(cfg, dict) and "spec" not in cfg)
            else cfg
            for name, cfg in value.items()
        }

    @model_validator(mode="after")
    def _tenants_fit(self) -> RewardWorkerConfig:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")
        for tenant in self.tenants:
            unknown = [e for e in tenant.endpoints if e not in self.endpoints]
            if unknown:
                raise ValueError(
                    f"tenant {tenant.name!r} names endpoints {unknown} that are not in endpoints "
                    f"({sorted(self.endpoints)}); add them there"
                )
        return self
