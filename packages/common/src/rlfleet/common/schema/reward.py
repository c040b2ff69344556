"""The reward tier's settings: a reward worker's (or shared reward server's) endpoints, scalers and tenants.

:class:`RewardWorkerConfig` is what ``rlfleet-reward serve --config`` reads (``deploy/reward.yaml``
is one); :class:`EndpointConfig` (a reward spec and an optional :class:`ScalerConfig`) is also
what a run sends when it creates or swaps an endpoint. :class:`EnvironmentConfig` (an environment
spec, its step deadline and its :class:`SandboxLimits`) is the operator's alone: no message creates
an environment. Torch-free.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from pathlib import PurePath
from typing import Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfleet.common.schema.worker import ModelLoading, ServiceConfig

Spec = str | dict[str, Any]
"""A reward spec: text (``'0.7*rm:path=/m + 0.3*concise'``) or its dict form."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


MIB = 1 << 20


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


class SandboxLimits(BaseModel):
    """What one run of model-written code (the ``python`` tool) may use; each limit hit ends the run
    and becomes the tool's error observation (:mod:`rlfleet.reward.sandbox`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_s: int = Field(default=5, ge=1, le=600, description="CPU seconds (RLIMIT_CPU)")
    wall_s: float = Field(
        default=10.0, gt=0, le=600, allow_inf_nan=False,
        description="wall-clock seconds; past them the run's processes are killed",
    )  # fmt: skip
    memory_mb: int = Field(default=512, ge=64, description="address space in MiB (RLIMIT_AS)")
    output_bytes: int = Field(
        default=16384, ge=256, le=1 << 16, description="output (stdout and stderr) kept; the rest is cut"
    )
    file_bytes: int = Field(
        default=16 * MIB, ge=0, description="largest file the code may write (RLIMIT_FSIZE)"
    )
    namespaces: Literal["auto", "required", "off"] = Field(
        default="auto",
        description="user, network, mount and pid namespaces (unshare): 'auto' uses them where the host "
        "allows (else sockets are still refused, by a seccomp filter and blocked imports, but the code can "
        "read what the worker's user can, /proc of its processes included); 'required' refuses to start "
        "without them (a shared server should say so); 'off' never uses them",
    )


class EnvironmentConfig(BaseModel):
    """One environment a reward server runs: a built-in environment and its options, set by the operator."""

    model_config = ConfigDict(extra="forbid")

    environment: Spec = Field(
        description="the built-in environment and its options: 'calculator:max_turns=6,tools=calculator|"
        "python', or {name: calculator, args: {max_turns: 6}}"
    )
    step_s: float = Field(
        default=30.0, gt=0, le=3600, allow_inf_nan=False,
        description="wall-clock seconds one reset or step may take (its tools included); past them the "
        "request fails with 'timeout' and the episode is dropped",
    )  # fmt: skip
    sandbox: SandboxLimits = Field(
        default_factory=SandboxLimits, description="limits of the code its python tool runs"
    )


def _bare_specs(value: Any, key: str) -> Any:
    """``name: spec`` (text, or a dict without ``key``) as ``name: {key: spec}``."""
    if not isinstance(value, dict):
        return value
    return {
        name: {key: cfg} if isinstance(cfg, str) or (isinstance(cfg, dict) and key not in cfg) else cfg
        for name, cfg in value.items()
    }


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class StoreRule(NamedTuple):
    """One entry of a tenant's ``stores``, parsed: an IP network and a port (None: any)."""

    network: IPNetwork
    port: int | None

    def admits(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> bool:
        """Whether the store at ``ip:port`` is one this rule allows."""
        return ip.version == self.network.version and ip in self.network and self.port in (None, port)


def parse_store_rule(entry: str) -> StoreRule:
    """A ``stores`` entry as an IP network and a port: ``10.1.2.3:7000``, ``10.1.0.0/16:*``,
    ``[fd00::/8]:*``, ``10.1.0.0/16`` (any port), or the previous release's octet globs
    (``10.1.*:*`` is ``10.1.0.0/16:*``). Names are refused: a name is not an address (the server
    resolves a store's name once and checks the address it gets). ValueError saying what to write.
    """
    text = entry.strip()
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"stores entry {entry!r}: write an IPv6 network as '[fd00::/8]:PORT'")
        port = rest[1:] or "*"
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, "*"
    return StoreRule(_store_network(entry, host), _store_port(entry, port))


def _store_network(entry: str, host: str) -> IPNetwork:
    if "*" in host:  # the previous release's glob form: whole trailing octets only
        parts = host.split(".")
        fixed = [p for p in parts if p != "*"]
        if not fixed or len(parts) > 4 or parts[: len(fixed)] != fixed or not all(p.isdigit() for p in fixed):
            raise ValueError(f"stores entry {entry!r}: write an IP network (CIDR), e.g. '10.1.0.0/16:*'")
        host = ".".join(fixed + ["0"] * (4 - len(fixed))) + f"/{8 * len(fixed)}"
    try:
        return ipaddress.ip_network(host, strict=True)
    except ValueError as exc:
        raise ValueError(
            f"stores entry {entry!r}: {host!r} is not an IP address or network ({exc}); a store's name is "
            "resolved when a request names it, so list its address or network (CIDR, e.g. '10.1.0.0/16:*')"
        ) from None


def _store_port(entry: str, port: str) -> int | None:
    if port == "*":
        return None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"stores entry {entry!r}: the port must be a number from 1 to 65535, or '*'")
    return int(port)


class TenantLimits(BaseModel):
    """What one tenant's score request may make a shared reward server fetch, hold and compute.

    Checked before any work: a request over a byte cap is refused (``batch_too_large``) before its
    texts are fetched, from the sizes the tenant's store declares, and a store that sends more than
    it declared is cut off at the declared size. Bytes count the texts and their offsets as stored
    (UTF-8); decoding them takes about three times as much memory while a request is scored.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    sample_bytes: int = Field(
        default=MIB, ge=1, description="text bytes of one sample (its prompt and its response)"
    )
    request_bytes: int = Field(
        default=256 * MIB, ge=1,
        description="bytes one request makes the server fetch (texts, offsets, group index)",
    )  # fmt: skip
    bytes_in_flight: int = Field(
        default=1024 * MIB, ge=1,
        description="bytes the tenant's requests in progress hold at once in one replica; a request past "
        "it is refused with a retryable quota_exceeded",
    )  # fmt: skip
    request_s: float = Field(
        default=600.0, gt=0, allow_inf_nan=False,
        description="the longest one request may compute when it carries no earlier deadline; past it "
        "(or past the request's own deadline) the work stops and the request fails with 'timeout'",
    )  # fmt: skip


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
    endpoints: list[str] = Field(
        default_factory=list, description="endpoints and environments (by name) this tenant may use"
    )
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
        description="TensorStores its requests may name, as IP addresses or networks with a port or '*' "
        "('10.0.1.0/24:*', '10.0.1.5:7000', '[fd00::/8]:*'; the previous release's '10.0.1.*:*' reads as "
        "10.0.1.0/24); a store named by a host name is resolved once and the address checked is the "
        "one connected to; empty: any",
    )
    can_update: bool = Field(
        default=False, description="may hot-swap the reward of its own endpoints (rule specs only)"
    )
    model_dirs: list[str] = Field(
        default_factory=list,
        description="absolute directories under which its specs may name reward models (rm:path, "
        "similarity:model, a swap's model_path); empty: none (built-in models only)",
    )
    limits: TenantLimits | None = Field(
        default=None, description="its byte and time caps; None: the server's tenant_limits"
    )

    @field_validator("stores")
    @classmethod
    def _stores_are_addresses(cls, stores: list[str]) -> list[str]:
        for entry in stores:
            parse_store_rule(entry)
        return stores

    @field_validator("model_dirs")
    @classmethod
    def _model_dirs_are_absolute(cls, dirs: list[str]) -> list[str]:
        relative = [d for d in dirs if not PurePath(d).is_absolute()]
        if relative:
            raise ValueError(f"model_dirs must be absolute directories, got {relative}")
        return dirs


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
    tenant_limits: TenantLimits = Field(
        default_factory=TenantLimits,
        description="every tenant's byte and time caps (a tenant's own limits replace them)",
    )
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
    environments: dict[str, EnvironmentConfig] = Field(
        default_factory=dict,
        description="environment name -> {environment, step_s, sandbox} (a bare spec means {environment: "
        "...}); served "
        "on env.reset to rollout workers' episodes; none: the worker serves no environment",
    )
    max_episodes: int = Field(
        default=4096, ge=1,
        description="live episodes this worker holds at once; with tenants, each holds at most an even share",
    )  # fmt: skip
    episode_idle_s: float = Field(
        default=600.0, gt=0, allow_inf_nan=False,
        description="an episode not stepped for this long is dropped (a later step is refused)",
    )  # fmt: skip

    @field_validator("endpoints", mode="before")
    @classmethod
    def _bare_endpoint_specs(cls, value: Any) -> Any:
        return _bare_specs(value, "spec")

    @field_validator("environments", mode="before")
    @classmethod
    def _bare_environment_specs(cls, value: Any) -> Any:
        return _bare_specs(value, "environment")

    @model_validator(mode="after")
    def _tenants_fit(self) -> RewardWorkerConfig:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")
        for tenant in self.tenants:
            unknown = [e for e in tenant.endpoints if e not in self.endpoints and e not in self.environments]
            if unknown:
                raise ValueError(
                    f"tenant {tenant.name!r} names endpoints {unknown} that are neither in endpoints "
                    f"({sorted(self.endpoints)}) nor in environments ({sorted(self.environments)}); add them "
                    "there"
                )
        return self
