"""Tenants of a shared reward server: who may score on which endpoint, how fast, and with what code.

A tenant has a name, an API token, a quota (``requests_per_s`` with a ``burst`` over every
request it sends, counted by a :class:`~rlfleet.reward.quota_store.QuotaStore` that every replica
of the server shares by default; ``max_batch`` samples per request; ``concurrency`` requests at
once in each replica), the
endpoints it may use and the TensorStore addresses (``stores``) its requests may name. A tenant
never runs code on the server: a spec it sets may name built-in rules only, or functions of the
modules the operator lists in ``allowed_modules`` (:meth:`TenantTable.check_spec`). The
concurrency caps default to an even split of the server's ``max_concurrency``, so a tenant within
its quota cannot take every slot from the others. A token is given in the config as
``token`` (plain), ``token_sha256`` (its hex digest, so the config holds no secret) or
``token_env`` (the name of an environment variable, read when the server starts).

:class:`TenantTable` answers "who is this token?" by comparing SHA-256 digests with
``hmac.compare_digest`` against every tenant (no early exit), so the answer takes the same time
whichever tenant matches, or none. A server with no tenants is *open*: every request is accepted
(the embedded default of a training run). Every refusal raises the error of its wire code and logs
a line naming the tenant, never the token.

Resources a tenant controls (issue 29): its ``stores`` are IP networks (:class:`StoreRule`); a
store a request names by a host name is resolved once, the address is checked, and that address
is what the server connects to (:meth:`TenantTable.admit_store`: a name shaped like an allowed
address, or one whose DNS answer changes later, cannot lead the server elsewhere). Its
:class:`TenantLimits` bound the bytes one sample and one request make the server fetch and the
bytes its requests hold at once (:meth:`TenantTable.check_bytes`, :meth:`TenantTable.holding`),
and how long a request may compute (:meth:`TenantTable.deadline`). A model directory its spec
names must lie under its ``model_dirs``; any other path is refused with one message, whether it
exists or not (:meth:`TenantTable.check_model_paths`).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlfleet.common.schema.reward import (
    StoreRule,
    TenantConfig,
    TenantLimits,
    TokenSource,
    parse_store_rule,
    token_digest,
)
from rlfleet.reward.errors import (
    BatchTooLarge,
    ForbiddenEndpoint,
    ForbiddenOperation,
    InvalidToken,
    MissingToken,
    QuotaExceeded,
    TenantConfigError,
    TextsTooLarge,
)
from rlfleet.reward.quota_store import ProcessQuotas, QuotaStore
from rlfleet.reward.registry import model_paths
from rlfleet.reward.spec import RewardSpec

logger = logging.getLogger(__name__)

ADMIN = "admin"
OPEN = ""
RESOLVE_TIMEOUT_S = 5.0
"""The longest the server waits for the name of a store a request names to resolve."""
MODEL_PATH_REFUSED = (
    "load a reward model from that path (a tenant's models load only from under its model_dirs)"
)
"""The one refusal of every model path a tenant may not use: a missing path and an existing one read alike."""

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
TextLimit = Literal["sample_bytes", "request_bytes", "declared_bytes"]


@dataclass(frozen=True)
class StoreTarget:
    """Where to fetch a request's texts: ``connect`` is the ``host:port`` to dial, the address the
    tenant's ``stores`` admitted (the request's own ``address`` where nothing was checked);
    ``server_name`` is the host name the request gave when ``connect`` is the address it resolved
    to (a TLS store's certificate is checked against it)."""

    address: str
    connect: str
    server_name: str = ""


@dataclass
class Tenant:
    """A tenant as the server holds it: config, token digest, rate and burst, slots, refusal counts."""

    config: TenantConfig
    digest: bytes
    rate: float | None
    capacity: float
    concurrency: int
    limits: TenantLimits = field(default_factory=TenantLimits)
    stores: tuple[StoreRule, ...] = ()
    model_dirs: tuple[Path, ...] = ()
    in_flight: int = 0
    bytes_in_flight: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name


def _digest(source: TokenSource, who: str) -> bytes:
    """The SHA-256 of ``source``'s token (``token_env`` read now); an unusable one is the config's
    mistake (:class:`TenantConfigError`: the server exits 2 with one line)."""
    try:
        return source.digest(who)
    except ValueError as exc:
        raise TenantConfigError(who, str(exc).removeprefix(f"{who}: ")) from None


class TenantTable:
    """Resolves tokens to tenants and enforces what each may do; open when it has no tenants."""

    def __init__(
        self,
        tenants: Iterable[TenantConfig],
        *,
        admin: TokenSource | None = None,
        clock: Callable[[], float] = time.monotonic,
        allowed_modules: Iterable[str] = (),
        max_concurrency: int = 4,
        quotas: QuotaStore | None = None,
        limits: TenantLimits | None = None,
    ) -> None:
        configs = list(tenants)
        default_limits = limits or TenantLimits()
        share = max(1, max_concurrency // max(1, len(configs)))
        self.allowed_modules = frozenset(allowed_modules)
        self.quotas: QuotaStore = quotas if quotas is not None else ProcessQuotas(clock)
        self.tenants: list[Tenant] = []
        for cfg in configs:
            rate = cfg.requests_per_s
            capacity = float(cfg.burst or max(1, math.ceil(rate or 1.0)))
            slots = cfg.concurrency or share
            self.tenants.append(Tenant(
                cfg, _digest(cfg, f"tenant {cfg.name!r}"), rate, capacity, slots,
                limits=cfg.limits or default_limits,
                stores=tuple(parse_store_rule(entry) for entry in cfg.stores),
                model_dirs=tuple(Path(os.path.realpath(d)) for d in cfg.model_dirs),
            ))  # fmt: skip
        if sum(t.concurrency for t in self.tenants) > max_concurrency:
            logger.warning("the tenants' concurrency caps add up to more than max_concurrency (%d): a busy "
                           "tenant can delay the others' requests", max_concurrency)  # fmt: skip
        self._slots_lock = threading.Lock()
        self.admin_digest = _digest(admin, "admin token") if admin is not None else None
        digests = [t.digest for t in self.tenants] + ([self.admin_digest] if self.admin_digest else [])
        if len(set(digests)) != len(digests):
            raise TenantConfigError("tenants", "two tenants (or a tenant and the admin) share a token; "
                                    "give each its own")  # fmt: skip

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

    def check_endpoint(self, tenant: Tenant | None, endpoint: str, what: str = "endpoint") -> None:
        """Raise :class:`ForbiddenEndpoint` unless ``tenant`` (None: admin/open) may use ``endpoint``
        (``what``: an ``endpoint`` or an ``environment``; a tenant's ``endpoints`` list both by name)."""
        if tenant is not None and endpoint not in tenant.config.endpoints:
            error = ForbiddenEndpoint(tenant.name, endpoint, tenant.config.endpoints, what)
            raise self._refuse(tenant, error, error.code)

    def check_episodes(self, tenant: Tenant | None, held: int, max_episodes: int) -> None:
        """Raise :class:`QuotaExceeded` (``episodes``, retryable) when ``tenant`` already holds ``held``
        live episodes, its even share of the replica's ``max_episodes``."""
        if tenant is None:
            return
        share = max(1, max_episodes // len(self.tenants))
        if held >= share:
            raise self._refuse(tenant, QuotaExceeded(tenant.name, "episodes", share), "episodes")

    def check_update(self, tenant: Tenant | None, endpoint: str) -> None:
        """Raise unless ``tenant`` may hot-swap ``endpoint`` (its own, with ``can_update``)."""
        self.check_endpoint(tenant, endpoint)
        if tenant is not None and not tenant.config.can_update:
            error = ForbiddenOperation(tenant.name, f"update the reward of {endpoint!r}")
            raise self._refuse(tenant, error, error.code)

    def check_spec(self, tenant: Tenant | None, spec: RewardSpec) -> None:
        """Raise :class:`ForbiddenOperation` if ``tenant`` (None: admin/open) names code to import
        in ``spec``.

        ``module:function`` components are the only spec form that imports by name (rules and
        model components are built-ins; model directories load with ``local_files_only`` and no
        remote code). A tenant may name functions of ``allowed_modules`` (exact module names).
        """
        if tenant is None:
            return
        for comp in spec.components:
            if comp.is_user_function and comp.name.partition(":")[0] not in self.allowed_modules:
                what = (f"load code {comp.name!r} on this shared reward server (tenants' specs use built-in "
                        "rules and the modules the operator lists in allowed_modules)")  # fmt: skip
                error = ForbiddenOperation(tenant.name, what, self.allowed_modules, "admitted modules")
                raise self._refuse(tenant, error, "code_not_allowed")
        self.check_model_paths(tenant, model_paths(spec))

    def check_model_paths(self, tenant: Tenant | None, paths: Iterable[str]) -> None:
        """Raise :class:`ForbiddenOperation` unless every model directory in ``paths`` lies under the
        tenant's ``model_dirs`` (after symlinks and ``..``; relative paths and Hub ids never do).

        Every refusal is the same message (:data:`MODEL_PATH_REFUSED`, without the path), whether the
        path exists or not, so a tenant cannot probe the server's files with it.
        """
        if tenant is None:
            return
        for path in paths:
            real = Path(os.path.realpath(path)) if Path(path).is_absolute() else None
            if real is None or not any(real.is_relative_to(root) for root in tenant.model_dirs):
                error = ForbiddenOperation(tenant.name, MODEL_PATH_REFUSED, tenant.config.model_dirs,
                                           "its model_dirs")  # fmt: skip
                raise self._refuse(tenant, error, "forbidden_path")

    async def admit_store(self, tenant: Tenant | None, address: str) -> StoreTarget:
        """Where to fetch from a store ``address`` names (``host:port``), if the tenant's ``stores`` allow it.

        A host name is resolved once (:data:`RESOLVE_TIMEOUT_S`); the first address it resolves to
        that a rule admits is the one returned to connect to, so the check and the connection see
        the same address. :class:`ForbiddenOperation` (one message for every refusal: not an
        address, no rule admits it, the name does not resolve) otherwise. No ``stores``: any address.
        """
        if tenant is None or not tenant.stores:
            return StoreTarget(address, address)
        host, _, port_text = address.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        port = int(port_text) if port_text.isdigit() and 0 < int(port_text) < 65536 else None
        if host and port is not None:
            for ip in await self._addresses(host, port):
                if any(rule.admits(ip, port) for rule in tenant.stores):
                    connect = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
                    return StoreTarget(address, connect, "" if _is_ip(host) else host)
        error = ForbiddenOperation(tenant.name, f"fetch rollouts from {address!r}", tenant.config.stores,
                                   "its stores")  # fmt: skip
        raise self._refuse(tenant, error, "forbidden_store")

    @staticmethod
    async def _addresses(host: str, port: int) -> list[IPAddress]:
        """``host`` as IP addresses: itself when it is one, else what it resolves to now (maybe none)."""
        if _is_ip(host):
            return [_plain(ipaddress.ip_address(host))]
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S
            )
        except (OSError, TimeoutError, UnicodeError) as exc:
            logger.info("store host %r does not resolve: %s", host, exc)
            return []
        return [_plain(ipaddress.ip_address(str(info[4][0]).partition("%")[0])) for info in infos]

    def check_bytes(
        self, tenant: Tenant | None, limit: TextLimit, nbytes: int, *, cap: int | None = None
    ) -> None:
        """Raise :class:`TextsTooLarge` when ``nbytes`` (of one sample, or of a request's texts) is
        over the tenant's ``limit`` (``declared_bytes``: over ``cap``, what its store declared)."""
        if tenant is None:
            return
        if cap is None:
            cap = tenant.limits.sample_bytes if limit == "sample_bytes" else tenant.limits.request_bytes
        if nbytes > cap:
            raise self._refuse(tenant, TextsTooLarge(tenant.name, limit, nbytes, cap), limit)

    @contextmanager
    def holding(self, tenant: Tenant | None, nbytes: int) -> Iterator[None]:
        """Count ``nbytes`` of texts against the tenant's ``bytes_in_flight`` while the block runs;
        :class:`QuotaExceeded` (retryable) when they do not fit beside its other requests'."""
        if tenant is None:
            yield
            return
        cap = tenant.limits.bytes_in_flight
        with self._slots_lock:
            if tenant.bytes_in_flight + nbytes > cap:
                raise self._refuse(
                    tenant, QuotaExceeded(tenant.name, "bytes_in_flight", cap), "bytes_in_flight"
                )
            tenant.bytes_in_flight += nbytes
        try:
            yield
        finally:
            with self._slots_lock:
                tenant.bytes_in_flight -= nbytes

    @staticmethod
    def deadline(tenant: Tenant | None, requested: float | None) -> float | None:
        """When a request's work must stop (UNIX seconds): its own ``deadline``, or for a tenant the
        earlier of that and ``request_s`` from now; None: no deadline (the admin's or an open server's)."""
        if tenant is None:
            return requested
        cap = time.time() + tenant.limits.request_s
        return cap if requested is None else min(requested, cap)

    @contextmanager
    def slot(self, tenant: Tenant | None) -> Iterator[None]:
        """Hold one of the tenant's ``concurrency`` slots; :class:`QuotaExceeded` when all are taken."""
        if tenant is None:
            yield
            return
        with self._slots_lock:
            if tenant.in_flight >= tenant.concurrency:
                error = QuotaExceeded(tenant.name, "concurrency", tenant.concurrency)
                raise self._refuse(tenant, error, "tenant_busy")
            tenant.in_flight += 1
        try:
            yield
        finally:
            with self._slots_lock:
                tenant.in_flight -= 1

    async def take_request(self, tenant: Tenant | None) -> None:
        """Count one request (of any kind) against the tenant's rate; :class:`QuotaExceeded` when over it.

        The count is the quota store's (:mod:`rlfleet.reward.quota_store`: this process, or a bucket
        every replica shares); :class:`QuotaStoreUnavailable` when a shared one does not answer.
        """
        if tenant is None or tenant.rate is None:
            return
        wait = await self.quotas.take(tenant.name, tenant.rate, tenant.capacity)
        if wait > 0:
            error = QuotaExceeded(tenant.name, "requests_per_s", tenant.rate, wait)
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


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _plain(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (``::ffff:10.0.0.5``) as the IPv4 address it is."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip
