"""Tenants of a shared reward server: who may score on which endpoint, and how fast.

A tenant has a name, an API token, a quota (``requests_per_s`` with a ``burst``, and
``max_batch`` samples per request) and the endpoints it may use. A token is given in the config as
``token`` (plain), ``token_sha256`` (its hex digest, so the config holds no secret) or
``token_env`` (the name of an environment variable, read when the server starts).

:class:`TenantTable` answers "who is this token?" by comparing SHA-256 digests with
``hmac.compare_digest`` against every tenant (no early exit), so the answer takes the same time
whichever tenant matches, or none. A server with no tenants is *open*: every request is accepted
(the embedded default of a training run). Every refusal raises its own error and logs a line
naming the tenant, never the token.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlfleet.reward.errors import (
    BatchTooLarge,
    ForbiddenEndpoint,
    ForbiddenOperation,
    InvalidToken,
    MissingToken,
    QuotaExceeded,
)

logger = logging.getLogger(__name__)

ADMIN = "admin"
OPEN = ""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def token_digest(token: str) -> bytes:
    """SHA-256 of a token: what is compared, so every comparison has the same length."""
    return hashlib.sha256(token.encode()).digest()


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
        default=None, gt=0, description="score requests per second; None: no cap"
    )
    burst: int | None = Field(default=None, ge=1, description="requests allowed at once; None: max(1, rate)")
    max_batch: int | None = Field(default=None, ge=1, description="samples per request; None: no cap")
    can_update: bool = Field(default=True, description="may hot-swap the reward of its own endpoints")


@dataclass
class TokenBucket:
    """``rate`` tokens per second up to ``capacity``; a request takes one token or is refused."""

    rate: float
    capacity: float
    clock: Callable[[], float] = time.monotonic
    tokens: float = field(init=False)
    updated: float = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.tokens = self.capacity
        self.updated = self.clock()

    def take(self) -> float:
        """0.0 if a token was taken, else the seconds until one is there."""
        with self._lock:
            now = self.clock()
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return 0.0
            return (1.0 - self.tokens) / self.rate


@dataclass
class Tenant:
    """A tenant as the server holds it: config, token digest, quota bucket and refusal counts."""

    config: TenantConfig
    digest: bytes
    bucket: TokenBucket | None
    refused: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name


class TenantTable:
    """Resolves tokens to tenants and enforces what each may do; open when it has no tenants."""

    def __init__(
        self,
        tenants: Iterable[TenantConfig],
        *,
        admin: TokenSource | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tenants: list[Tenant] = []
        for cfg in tenants:
            bucket = None
            if cfg.requests_per_s is not None:
                capacity = float(cfg.burst or max(1, math.ceil(cfg.requests_per_s)))
                bucket = TokenBucket(cfg.requests_per_s, capacity, clock)
            self.tenants.append(Tenant(cfg, cfg.digest(f"tenant {cfg.name!r}"), bucket))
        self.admin_digest = admin.digest("admin token") if admin is not None else None
        digests = [t.digest for t in self.tenants] + ([self.admin_digest] if self.admin_digest else [])
        if len(set(digests)) != len(digests):
            raise ValueError("two tenants (or a tenant and the admin) share a token; give each its own")

    @property
    def open(self) -> bool:
        """No tenants: every request is accepted."""
        return not self.tenants

    def identify(self, token: str, operation: str) -> Tenant | None:
        """The tenant owning ``token``; None for the admin token or an open server.

        Raises :class:`MissingToken` / :class:`InvalidToken` (and logs why) otherwise.
        """
        if self.open:
            return None
        if not token:
            logger.warning("refused %s: no token", operation)
            raise MissingToken(operation)
        digest = token_digest(token)
        found: Tenant | None = None
        for tenant in self.tenants:  # no early exit: same time whichever tenant matches
            if hmac.compare_digest(digest, tenant.digest):
                found = tenant
        is_admin = self.admin_digest is not None and hmac.compare_digest(digest, self.admin_digest)
        if found is None and not is_admin:
            logger.warning("refused %s: invalid token", operation)
            raise InvalidToken(operation)
        return found

    def is_admin(self, token: str) -> bool:
        """Whether ``token`` is the admin token (always True on an open server)."""
        if self.open:
            return True
        if self.admin_digest is None or not token:
            return False
        return hmac.compare_digest(token_digest(token), self.admin_digest)

    def _refuse(self, tenant: Tenant, error: Exception, code: str) -> Exception:
        tenant.refused[code] = tenant.refused.get(code, 0) + 1
        logger.warning("refused tenant %s: %s", tenant.name, error)
        return error

    def check_endpoint(self, tenant: Tenant | None, endpoint: str) -> None:
        """Raise :class:`ForbiddenEndpoint` unless ``tenant`` (None: admin/open) may use ``endpoint``."""
        if tenant is not None and endpoint not in tenant.config.endpoints:
            error = ForbiddenEndpoint(tenant.name, endpoint, tenant.config.endpoints)
            raise self._refuse(tenant, error, error.code)

    def check_update(self, tenant: Tenant | None, endpoint: str) -> None:
        """Raise unless ``tenant`` may hot-swap ``endpoint`` (its own, with ``can_update``)."""
        self.check_endpoint(tenant, endpoint)
        if tenant is not None and not tenant.config.can_update:
            error = ForbiddenOperation(tenant.name, f"update the reward of {endpoint!r}")
            raise self._refuse(tenant, error, error.code)

    def take_request(self, tenant: Tenant | None) -> None:
        """Count one request against the tenant's rate; raise :class:`QuotaExceeded` when over it."""
        if tenant is None or tenant.bucket is None:
            return
        wait = tenant.bucket.take()
        if wait > 0:
            error = QuotaExceeded(tenant.name, tenant.bucket.rate, wait)
            raise self._refuse(tenant, error, error.code)

    def check_batch(self, tenant: Tenant | None, samples: int) -> None:
        """Raise :class:`BatchTooLarge` when ``samples`` is over the tenant's ``max_batch``."""
        if tenant is None or tenant.config.max_batch is None or samples <= tenant.config.max_batch:
            return
        error = BatchTooLarge(tenant.name, samples, tenant.config.max_batch)
        raise self._refuse(tenant, error, error.code)

    def visible(self, tenant: Tenant | None, endpoints: Iterable[str]) -> list[str]:
        """The endpoints ``tenant`` may see (all of them for the admin or an open server)."""
        if tenant is None:
            return sorted(endpoints)
        return sorted(e for e in endpoints if e in tenant.config.endpoints)

    @staticmethod
    def label(tenant: Tenant | None, open_server: bool) -> str:
        """Who a request came from, for stats: the tenant's name, ``admin``, or ``""`` when open."""
        if tenant is not None:
            return tenant.name
        return OPEN if open_server else ADMIN
