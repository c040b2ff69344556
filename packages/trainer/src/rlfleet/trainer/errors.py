"""Errors of rlfleet-trainer; shared ones (ConfigError, BatchContractError, ...) live in
``rlfleet.common.errors``. Every one is a :class:`UserError` (the user can fix it) but the two of a
trainer rank that failed or died (:class:`Failure`); the codes of those that cross the wire come
from :data:`~rlfleet.common.errors.WIRE_CODES`.
"""

from __future__ import annotations

from rlfleet.common.errors import Failure, UserError
from rlfleet.common.errors import JobIdReused as JobIdReused  # moved to common: rollout raises it too
from rlfleet.common.errors import SettingsConflict as SettingsConflict  # one class, every tier's


class ModelLoadError(UserError, FileNotFoundError):
    """A model directory is missing or holds no HF config."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot load a causal LM from {path!r}: {reason}")


class CheckpointError(UserError, FileNotFoundError):
    """A training checkpoint directory is missing a part, or does not fit this run."""

    def __init__(self, path: object, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"training checkpoint {self.path!r} {reason}")


class CheckpointPathRefused(UserError, PermissionError):
    """A ``trainer.save``/``trainer.load`` path from the wire lies outside the checkpoint root."""

    code = "forbidden"

    def __init__(self, path: str, root: object, reason: str) -> None:
        self.path = path
        self.root = str(root)
        self.reason = reason
        super().__init__(f"checkpoint path {path!r} refused: {reason} (checkpoint root {self.root!r})")


class UnexpectedMessage(UserError, TypeError):
    """A trainer subject received a message of another kind than the one it serves."""

    code = "bad_request"

    def __init__(self, subject: str, expected: str, got: str) -> None:
        self.subject = subject
        self.expected = expected
        self.got = got
        super().__init__(f"{subject} takes {expected} messages, got {got!r}")


class CarrierUnavailable(UserError, ValueError):
    """A publish asks for a weight carrier this trainer cannot serve (CUDA IPC from a CPU trainer)."""

    code = "bad_request"

    def __init__(self, carrier: str, reason: str) -> None:
        self.carrier = carrier
        self.reason = reason
        super().__init__(f"the {carrier} weight carrier {reason}")


class TrainerRankFailed(Failure, RuntimeError):
    """Another trainer rank failed a command before its first collective (every rank skipped it).

    ``code`` and ``retryable`` are those of that rank's own error (a rollout store it could not
    reach is ``unavailable``, so the controller retries; a damaged checkpoint is ``bad_request``).
    """

    def __init__(
        self, rank: int, what: str, error: str, code: str = "internal", retryable: bool = False
    ) -> None:
        self.rank = rank
        self.what = what
        self.error = error
        self.code = code
        self.retryable = retryable
        super().__init__(f"trainer rank {rank} could not {what}: {error}")


class TrainerRankDied(Failure, RuntimeError):
    """A trainer rank stopped answering (its heartbeat in the rendezvous store went silent): it died
    or froze. Rank 0 answers what it was asked with this, then exits so that the ranks restart together."""

    code = "internal"
    retryable = False

    def __init__(self, rank: int, silent_s: float, doing: str = "", how: str = "", then: str = "") -> None:
        self.rank = rank
        self.silent_s = silent_s
        self.doing = doing
        during = f" during {doing}" if doing else ""
        how = how or "no heartbeat in the ranks' rendezvous store: it died or froze"
        then = then or "rank 0 exits so that the trainer's ranks restart together"
        gone = f"stopped answering {silent_s:.0f} s ago" if silent_s > 0 else "is gone"
        super().__init__(f"trainer rank {rank} {gone}{during} ({how}); {then}")


class RanksOutOfStep(Failure, RuntimeError):
    """Rank 0 failed a command after its first collective: the other ranks wait in collectives it
    left, and no later command would pair with theirs. Rank 0 answers with this and exits, so that
    the ranks restart together (``error`` is what failed)."""

    code = "internal"
    retryable = False

    def __init__(self, doing: str, error: BaseException) -> None:
        self.doing = doing
        self.error = error
        during = f" in {doing}" if doing else ""
        super().__init__(
            f"trainer rank 0 failed{during} after the first collective ({type(error).__name__}: {error}); "
            "the ranks are out of step, so rank 0 exits so that they restart together"
        )
