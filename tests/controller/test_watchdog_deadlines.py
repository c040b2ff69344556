"""The stall watchdog follows each request's deadline (issue 35, point 2): a worker that heartbeats
and is busy is not named while its request is within the deadline its work was given (a held-out
evaluation of many prompts is long work, not a stall); a silent worker, or one that reports no work,
is named after ``stall_report_s`` as before."""

from __future__ import annotations

from rlfleet.common.control.membership import WorkerInfo
from rlfleet.common.control.messages import WorkerAnnounce
from rlfleet.controller.watchdog import Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class OneWorker:
    """A registry holding one rollout worker whose heartbeat the test sets."""

    def __init__(self) -> None:
        announce = WorkerAnnounce(
            tier="rollout", worker_id="rollout-0", subject="rlfleet.c.rollout.worker.rollout-0"
        )
        self.info = WorkerInfo(announce=announce, last_seen=0.0, weight_version=0)

    def get(self, tier: str, worker_id: str) -> WorkerInfo | None:
        return self.info if (tier, worker_id) == ("rollout", "rollout-0") else None

    def workers(self, tier: str) -> list[WorkerInfo]:
        return [self.info] if tier == "rollout" else []


def beat(registry: OneWorker, now: float, activity: str) -> None:
    registry.info.last_seen = now
    registry.info.activity = activity
    registry.info.busy = 1 if activity else 0


def watchdog(registry: OneWorker, clock: Clock) -> Watchdog:
    return Watchdog(60.0, registry=registry, clock=clock, lost_after_s=None)  # type: ignore[arg-type]


def test_a_busy_worker_within_its_requests_deadline_is_not_a_stall() -> None:
    clock, registry = Clock(), OneWorker()
    dog = watchdog(registry, clock)
    with dog.track("rollout", "rollout-0", "rollout.generate", "eval-1", deadline_s=572.0):
        for t in range(0, 572, 2):  # an evaluation of 66 prompts: 9.5 minutes of heartbeats saying so
            clock.now = float(t)
            beat(registry, clock.now, "generate eval-1")
            assert dog.check() == [], f"reported at {t} s, within the request's 572 s deadline"
        clock.now = 572.0
        beat(registry, clock.now, "generate eval-1")
        (report,) = dog.check()
        assert "no result for 572 s on rollout.generate job eval-1" in report.message
        clock.now = 600.0
        beat(registry, clock.now, "generate eval-1")
        assert dog.check() == []  # then each stall_report_s
        clock.now = 632.0
        beat(registry, clock.now, "generate eval-1")
        assert len(dog.check()) == 1


def test_a_silent_worker_is_named_after_stall_report_s_whatever_the_deadline() -> None:
    clock, registry = Clock(), OneWorker()
    dog = watchdog(registry, clock)
    beat(registry, 0.0, "generate g-1")
    with dog.track("rollout", "rollout-0", "rollout.generate", "g-1", deadline_s=572.0):
        clock.now = 59.0
        assert dog.check() == []
        clock.now = 60.0  # last heard at 0 s: not working on it, whatever it said
        (report,) = dog.check()
        assert "not heard for 60 s" in report.message and "no result for 60 s" in report.message


def test_an_idle_worker_is_named_after_stall_report_s() -> None:
    clock, registry = Clock(), OneWorker()
    dog = watchdog(registry, clock)
    with dog.track("rollout", "rollout-0", "rollout.generate", "g-2", deadline_s=572.0):
        clock.now = 60.0
        beat(registry, 59.0, "")  # heard, but reports no work in progress
        (report,) = dog.check()
        assert "it reports no activity" in report.message


def test_a_request_of_unknown_deadline_is_named_after_stall_report_s() -> None:
    clock, registry = Clock(), OneWorker()
    dog = watchdog(registry, clock)
    with dog.track("rollout", "rollout-0", "rollout.generate", "g-3"):
        clock.now = 60.0
        beat(registry, 60.0, "generate g-3")
        assert len(dog.check()) == 1


def test_a_worker_not_heard_since_the_request_is_given_its_next_beat() -> None:
    clock, registry = Clock(), OneWorker()
    dog = Watchdog(1.0, registry=registry, clock=clock, lost_after_s=None)  # type: ignore[arg-type]
    beat(registry, 0.0, "")  # its last beat came before the request: it says nothing of it
    clock.now = 0.5
    with dog.track("rollout", "rollout-0", "rollout.generate", "g-4", deadline_s=150.0):
        clock.now = 2.0
        assert dog.check() == []
        beat(registry, 2.5, "")  # a beat after the request, idle: it is not working on it
        clock.now = 3.0
        assert len(dog.check()) == 1
