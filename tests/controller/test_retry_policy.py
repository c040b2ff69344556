"""The controller's retry policy: retryable errors are retried with backoff, others raised at once,
``retry_after_s`` honoured, and a spent budget is RetriesExhausted naming the request."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.common.errors import remote_error
from rlfleet.controller.errors import RetriesExhausted
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.request_policy import backoff_s, is_retryable, with_retries


def _run(what, attempt, settings):
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    return asyncio.run(with_retries(what, attempt, settings, sleep=sleep)), waits


def _quota(after: float | None = None):
    exc = remote_error("reward", "QuotaExceeded", "tenant over quota", retryable=True)
    if after is not None:
        exc.retry_after_s = after
    return exc


@pytest.mark.timeout(10)
def test_retryable_then_success_backs_off_and_honours_retry_after():
    fails = [_quota(), _quota(after=7.0)]

    async def attempt():
        if fails:
            raise fails.pop(0)
        return "ok"

    result, waits = _run("score", attempt, FaultSettings(retry_backoff_s=0.5, retry_backoff_max_s=4.0))
    assert result == "ok"
    assert waits == [0.5, 7.0]


@pytest.mark.timeout(10)
def test_budget_spent_is_retries_exhausted():
    calls = []

    async def attempt():
        calls.append(1)
        raise _quota()

    with pytest.raises(RetriesExhausted) as info:
        _run("train_step job j1", attempt, FaultSettings(retry_attempts=3))
    assert len(calls) == 3 and info.value.attempts == 3 and "train_step job j1" in str(info.value)


@pytest.mark.timeout(10)
def test_non_retryable_raised_at_once():
    calls = []

    async def attempt():
        calls.append(1)
        raise remote_error("trainer", "BadRequest", "bad batch", retryable=False)

    with pytest.raises(Exception, match="bad batch"):
        _run("train_step", attempt, FaultSettings())
    assert len(calls) == 1


def test_backoff_doubles_and_caps():
    s = FaultSettings(retry_backoff_s=1.0, retry_backoff_max_s=5.0)
    assert [backoff_s(s, n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    assert not is_retryable(ValueError("x"))
