"""Where tenants' request quotas are counted: in this process, or in a key-value bucket every replica shares.

A quota is a token bucket: ``requests_per_s`` tokens a second, up to ``burst``; each request takes
one token or is refused with the seconds until one is there. :class:`ProcessQuotas` keeps the
buckets in this process (``quota_store: process``): each replica of a server counts alone, so N
replicas in the queue group give a tenant N times its rate. :class:`SharedQuotas` keeps them in
the NATS JetStream key-value bucket ``rlfleet-quotas-<cluster>`` (``quota_store: nats``, the
default), one key per tenant holding ``{"tokens": float, "at": unix seconds}``:

1. read the tenant's key (its revision comes with it);
2. refill for the time since ``at`` on this replica's wall clock; no token: refuse, write nothing;
3. write the bucket less one token with ``update(last=revision)``, which succeeds only if no other
   replica wrote since step 1; a lost race starts again (at most :data:`CAS_ATTEMPTS` times, with a
   short random pause), so concurrent requests on any number of replicas never take more tokens
   than the bucket holds.

Requests of one tenant on one replica take their turn on a local lock, so races are only between
replicas. The replicas' clocks should agree (NTP): a replica whose clock runs behind sees no refill
until it catches up, one ahead lets the bucket refill early by the difference. The bucket uses
memory storage: a restart of the NATS server loses it, and the first request after makes it again
(every tenant's bucket full).

:func:`open_quotas` picks the store. With ``nats``, a NATS server without JetStream (or a user not
allowed its API) stops the server at start with :class:`QuotaStoreMissing`; the bucket being
unreachable later (a NATS restart, a timeout) refuses that one request with the retryable
:class:`QuotaStoreUnavailable` and the server goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import Transport
from rlfleet.common.schema.reward import RewardWorkerConfig
from rlfleet.reward.errors import QuotaStoreMissing, QuotaStoreUnavailable

logger = logging.getLogger(__name__)

CAS_ATTEMPTS = 16
"""Compare-and-set tries of one request before it is refused as unavailable (replicas racing)."""
KV_TIMEOUT_S = 2.0
"""Seconds a JetStream call may take before the request it counts is refused as unavailable."""
MAX_STATE_BYTES = 256
"""A stored bucket larger than this is not read (it is not one of ours)."""
_NATS_FAILURES = (nats.errors.Error, asyncio.TimeoutError, OSError)


def quota_bucket(cluster: str) -> str:
    """The key-value bucket of ``cluster``'s reward server (cluster names are letters, digits, '-', '_')."""
    return f"rlfleet-quotas-{cluster}"


def quota_key(tenant: str) -> str:
    """The key of ``tenant``'s bucket: tenant names never hold '=', so '.' -> '=' keeps keys distinct."""
    return "requests." + tenant.replace(".", "=")


def refill(tokens: float, since: float, now: float, rate: float, capacity: float) -> float:
    """The tokens of a bucket that held ``tokens`` at ``since``, at ``now`` (never over ``capacity``)."""
    return min(capacity, tokens + max(0.0, now - since) * rate)


async def make_bucket(js: Any, bucket: str) -> KeyValue:
    """Make the quota bucket (memory storage, one revision per key); a replica racing us makes the same."""
    config = KeyValueConfig(bucket=bucket, history=1, storage=StorageType.MEMORY,
                            description="rlfleet reward server: tenants' request quotas")  # fmt: skip
    return await js.create_key_value(config)


class QuotaStore(Protocol):
    """Counts requests against token buckets keyed by tenant name."""

    name: str
    """Where the buckets live, for logs."""

    async def take(self, tenant: str, rate: float, capacity: float) -> float:
        """0.0 if one token was taken from ``tenant``'s bucket, else the seconds until one is there."""
        ...


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
            self.tokens = refill(self.tokens, self.updated, now, self.rate, self.capacity)
            self.updated = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return 0.0
            return (1.0 - self.tokens) / self.rate


class ProcessQuotas:
    """Token buckets in this process only (``quota_store: process``)."""

    name = "this process"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    async def take(self, tenant: str, rate: float, capacity: float) -> float:
        bucket = self._buckets.get(tenant)
        if bucket is None or (bucket.rate, bucket.capacity) != (rate, capacity):
            bucket = self._buckets[tenant] = TokenBucket(rate, capacity, self.clock)
        return bucket.take()


class _LostRace(Exception):
    """Another replica wrote the key between our read and our write."""


class SharedQuotas:
    """Token buckets in a JetStream key-value bucket that every replica shares (``quota_store: nats``)."""

    def __init__(self, js: Any, kv: KeyValue, bucket: str, *, clock: Callable[[], float] = time.time) -> None:
        self.js = js
        self.kv = kv
        self.bucket = bucket
        self.name = f"JetStream key-value bucket {bucket!r}"
        self.clock = clock
        self._locks: dict[str, asyncio.Lock] = {}

    @classmethod
    async def open(cls, client: Any, cluster: str, *, timeout: float = KV_TIMEOUT_S) -> SharedQuotas:
        """``cluster``'s bucket on ``client``'s NATS server (made if missing); QuotaStoreMissing if not."""
        bucket = quota_bucket(cluster)
        js = client.jetstream(timeout=timeout)
        try:
            await js.account_info()
        except nats.js.errors.ServiceUnavailableError:
            raise QuotaStoreMissing(bucket, "the NATS server has no JetStream") from None
        except nats.js.errors.APIError as exc:  # e.g. JetStream not enabled for this account
            raise QuotaStoreMissing(bucket, f"JetStream refused: {exc.description or exc}") from None
        except _NATS_FAILURES as exc:
            reason = f"JetStream did not answer in {timeout:g}s ({type(exc).__name__})"
            raise QuotaStoreMissing(bucket, f"{reason}: may this NATS user publish $JS.API.INFO?") from None
        try:
            try:
                kv = await js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                kv = await make_bucket(js, bucket)
        except _NATS_FAILURES as exc:
            reason = f"the bucket cannot be opened or made ({type(exc).__name__}: {exc})"
            needs = f"$JS.API.STREAM.INFO.KV_{bucket}, $JS.API.STREAM.CREATE.KV_{bucket} and $KV.{bucket}.>"
            raise QuotaStoreMissing(bucket, f"{reason}: may this NATS user publish {needs}?") from None
        return cls(js, kv, bucket)

    async def take(self, tenant: str, rate: float, capacity: float) -> float:
        key = quota_key(tenant)
        lock = self._locks.setdefault(key, asyncio.Lock())
        remade = False
        async with lock:  # this replica's requests of one tenant take turns: races are between replicas
            for attempt in range(CAS_ATTEMPTS):
                try:
                    return await self._take_once(key, rate, capacity)
                except _LostRace:
                    await asyncio.sleep(random.uniform(0.0, 0.002 * (attempt + 1)))
                except nats.js.errors.NoStreamResponseError:  # no bucket: a restarted NATS server lost it
                    if remade:
                        raise QuotaStoreUnavailable(self.bucket, "it is gone and was not made") from None
                    remade = True
                    await self._remake()
                except _NATS_FAILURES as exc:
                    logger.warning("quota store %s unreachable: %r", self.bucket, exc)
                    raise QuotaStoreUnavailable(self.bucket, f"{type(exc).__name__}: {exc}") from None
        raise QuotaStoreUnavailable(self.bucket, f"{CAS_ATTEMPTS} tries to count it lost to other replicas")

    async def _remake(self) -> None:
        try:
            self.kv = await make_bucket(self.js, self.bucket)
        except _NATS_FAILURES as exc:
            raise QuotaStoreUnavailable(self.bucket, f"it is gone and cannot be made: {exc!r}") from None
        logger.warning("quota bucket %s was gone (a NATS server restart?): made it again, so every tenant's "
                       "quota starts full", self.bucket)  # fmt: skip

    async def _take_once(self, key: str, rate: float, capacity: float) -> float:
        try:
            entry: KeyValue.Entry | None = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError:  # never written, or deleted
            entry = None
        now = self.clock()
        tokens, since = self._state(key, entry, capacity, now)
        tokens = refill(tokens, since, now, rate, capacity)
        if tokens < 1.0:
            return (1.0 - tokens) / rate
        value = json.dumps({"tokens": tokens - 1.0, "at": max(now, since)}).encode()
        try:
            if entry is None:
                await self.kv.create(key, value)
            else:
                await self.kv.update(key, value, last=entry.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise _LostRace from None
        return 0.0

    def _state(
        self, key: str, entry: KeyValue.Entry | None, capacity: float, now: float
    ) -> tuple[float, float]:
        """``(tokens, at)`` of a stored bucket; a full bucket when there is none or it is not ours."""
        if entry is None:
            return capacity, now
        raw = entry.value or b""
        try:
            if len(raw) > MAX_STATE_BYTES:
                raise ValueError(f"{len(raw)} bytes")
            state = json.loads(raw)
            tokens, since = float(state["tokens"]), float(state["at"])
            if not (math.isfinite(tokens) and math.isfinite(since)):
                raise ValueError("not finite")
        except (ValueError, TypeError, KeyError) as exc:
            logger.warning("quota key %s of %s holds no bucket (%s): starting it full", key, self.bucket, exc)
            return capacity, now
        return max(0.0, min(capacity, tokens)), since


async def open_quotas(config: RewardWorkerConfig, transport: Transport) -> QuotaStore:
    """The quota store the config asks for (per process when no tenant has a rate: nothing to share)."""
    if not any(t.requests_per_s for t in config.tenants):
        return ProcessQuotas()
    if config.quota_store == "process":
        logger.warning("quota_store: process: each replica counts tenants' quotas alone (N replicas give "
                       "a tenant N times its requests_per_s)")  # fmt: skip
        return ProcessQuotas()
    cluster = config.fleet.cluster
    if not isinstance(transport, NatsTransport):
        kind = type(transport).__name__
        raise QuotaStoreMissing(quota_bucket(cluster), f"this worker's transport ({kind}) is not NATS")
    store = await SharedQuotas.open(transport.client, cluster)
    logger.info("tenant quotas counted in %s, shared by every replica", store.name)
    return store
