"""Errors of rlfleet-trainer; shared ones (ConfigError, ...) live in ``rlfleet.common.errors``."""

from __future__ import annotations

from rlfleet.common.errors import RlfleetError


class TrainerError(RlfleetError):
    """Marker base for trainer errors; never raised on its own."""


class InvalidBatch(TrainerError, ValueError):
    """A rollout batch does not follow the tensor contract (missing key, bad shape or dtype)."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"rollout batch field {key!r}: {reason}")


class ModelLoadError(TrainerError, FileNotFoundError):
    """A model directory is missing or holds no HF config."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot load a causal LM from {path!r}: {reason}")


class CheckpointError(TrainerError, FileNotFoundError):
    """A training checkpoint directory is missing a part, or does not fit this run."""

    def __init__(self, path: object, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"training checkpoint {self.path!r} {reason}")
