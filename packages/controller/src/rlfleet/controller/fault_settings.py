"""How a run meets faults (issue 12): retry budgets, restart budgets, the stall watchdog, timeouts.

``TrainerConfig.faults`` holds one :class:`FaultSettings`; a job file sets it as a mapping::

    faults:
      retry_attempts: 6        # tries per request on a retryable error (QuotaExceeded, a dead peer)
      restart_budget: 2        # crashes the embedded launcher restarts per worker
      stall_report_s: 30       # the watchdog names a worker that owes a result for this long
      empty_pool_wait_s: 300   # work waits this long for a worker of an empty rollout pool to be back

Every field has a default that suits the embedded default; nothing here is needed to start.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from rlfleet.common.schema.config import ConfigModel


class FaultSettings(ConfigModel):
    """Retries, restarts, liveness and deadlines for one run."""

    retry_attempts: int = Field(
        default=5, ge=1, le=100,
        description="tries per score, train-step, publish or weight-load request on a retryable error "
        "(1: no retry); when they are spent the run stops with RetriesExhausted",
    )  # fmt: skip
    retry_backoff_s: float = Field(
        default=0.5, gt=0.0, le=60.0, description="wait before the first retry; it doubles on each retry"
    )
    retry_backoff_max_s: float = Field(
        default=15.0, gt=0.0, le=600.0, description="longest wait between two tries (retry_after can exceed)"
    )
    restart_budget: int = Field(
        default=3, ge=0, le=100,
        description="embedded launcher: restarts of a crashed rollout, reward or trainer process per worker "
        "over the run (0: any crash ends the run with TierDied)",
    )  # fmt: skip
    stall_report_s: float = Field(
        default=60.0, gt=0.0, le=3600.0,
        description="the watchdog reports a worker that owes a result for this long (alive or not), naming "
        "it, what it is doing and for how long",
    )  # fmt: skip
    dead_after_s: float = Field(
        default=10.0, gt=0.0, le=600.0,
        description="a worker unheard for this long while the controller's own NATS connection is up is dead "
        "(an outage of the connection pauses the count)",
    )  # fmt: skip
    outage_grace_s: float = Field(
        default=120.0, gt=0.0, le=3600.0,
        description="how long the run waits for a lost NATS connection to come back before it stops with a "
        "named cause",
    )  # fmt: skip
    empty_pool_wait_s: float = Field(
        default=300.0, gt=0.0, le=24 * 3600.0,
        description="how long work in flight (a generate job, a lost chunk made again, a weight sync or a "
        "late worker's weight load) waits for a rollout pool left without a live worker to have one again "
        "(a worker restarted by its launcher or rejoining); past it the run stops with NoWorkerServed "
        "naming the pool",
    )  # fmt: skip
    deadline_scale: float = Field(
        default=1.0, gt=0.0, le=1000.0, allow_inf_nan=False,
        description="multiplies every request deadline scaled to its work (controller/request_policy.py); "
        "raise it on slower hardware (request_timeout_s instead fixes one deadline for every request)",
    )  # fmt: skip

    @model_validator(mode="after")
    def _check_backoff(self) -> FaultSettings:
        if self.retry_backoff_max_s < self.retry_backoff_s:
            raise ValueError(
                f"faults.retry_backoff_max_s ({self.retry_backoff_max_s}) is below faults.retry_backoff_s "
                f"({self.retry_backoff_s})"
            )
        return self
