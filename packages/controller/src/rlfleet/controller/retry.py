"""One retry policy for the controller's score, train-step, publish and weight-load requests.

Why: a reward server answering ``QuotaExceeded``, a peer restarting, or a request nobody answered in
time should cost a retry, not the run (issue 12, point 1). Only errors that can pass are retried: a
``RemoteError`` marked ``retryable``, a ``RequestTimeout`` or ``NoResponders`` (the peer may come
back), a tensor store that is busy or unavailable. Everything else is raised at once. The wait
doubles from ``retry_backoff_s`` up to ``retry_backoff_max_s``; an error's ``retry_after_s``
(seconds the peer asked us to wait) wins when it is longer. When ``retry_attempts`` tries are
spent the last error is wrapped in :class:`RetriesExhausted` naming what was tried.

The caller keeps one ``job_id`` across the tries, so a trainer that already did the work answers
the repeat from its cache instead of stepping twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rlfleet.common.errors import (
    NoResponders,
    RemoteError,
    RequestTimeout,
    TensorStoreBusy,
    TensorStoreUnavailable,
)
from rlfleet.controller.errors import RetriesExhausted
from rlfleet.controller.fault_settings import FaultSettings

T = TypeVar("T")
log = logging.getLogger(__name__)

TRANSIENT = (RequestTimeout, NoResponders, TensorStoreBusy, TensorStoreUnavailable)


def is_retryable(exc: BaseException) -> bool:
    """Whether trying ``exc``'s request again can succeed."""
    if isinstance(exc, RemoteError):
        return bool(exc.retryable)
    return isinstance(exc, TRANSIENT) or getattr(exc, "retryable", False) is True


def backoff_s(settings: FaultSettings, attempt: int, exc: BaseException | None = None) -> float:
    """Seconds to wait after failed try number ``attempt`` (1-based): doubling, capped, at least
    the ``retry_after_s`` the error carries (a peer's own request to wait; never negative)."""
    wait = min(settings.retry_backoff_s * 2 ** (attempt - 1), settings.retry_backoff_max_s)
    after = getattr(exc, "retry_after_s", None)
    if isinstance(after, (int, float)) and after > wait:
        wait = min(float(after), 3600.0)
    return wait


async def with_retries(
    what: str, attempt: Callable[[], Awaitable[T]], settings: FaultSettings,
    *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    retry_if: Callable[[BaseException], bool] = is_retryable,
) -> T:  # fmt: skip
    """``await attempt()`` until it succeeds, retrying retryable errors within the budget.

    Raises the first non-retryable error as it is, and :class:`RetriesExhausted` (``what``, the
    number of tries, the last error) when ``settings.retry_attempts`` tries all failed retryably.
    ``retry_if`` narrows what counts as retryable for one kind of request.
    """
    for n in range(1, settings.retry_attempts + 1):
        try:
            return await attempt()
        except Exception as exc:
            if not retry_if(exc):
                raise
            if n == settings.retry_attempts:
                raise RetriesExhausted(what, n, exc) from exc
            wait = backoff_s(settings, n, exc)
            log.warning(
                "%s: try %d of %d failed (%s); retrying in %.1f s",
                what,
                n,
                settings.retry_attempts,
                exc,
                wait,
            )
            await sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover
