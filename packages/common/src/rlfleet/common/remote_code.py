"""Model folders that ship their own Python code (``auto_map`` in ``config.json``): one test and one
message for every tier's loaders.

``trust_remote_code`` (:class:`~rlfleet.common.schema.worker.ModelLoading`) is off by default; every
loader passes it to ``from_pretrained`` explicitly (never None, which would make transformers ask
on the terminal), and a refusal becomes a one-line error naming the setting.
"""

from __future__ import annotations

from pathlib import Path

REFUSAL_MARKS = ("custom code", "trust_remote_code=True")
"""What transformers' refusal to run a folder's code says (its ValueError)."""


def refused_remote_code(exc: BaseException) -> bool:
    """Whether ``exc`` is transformers refusing to run a model folder's code."""
    return isinstance(exc, ValueError) and all(mark in str(exc) for mark in REFUSAL_MARKS)


def remote_code_reason(folder: str | Path) -> str:
    """The one-line reason a loader gives for a refused folder, saying what to set."""
    return (
        f"{folder} ships its own Python code (auto_map in its config.json) and trust_remote_code is off; "
        "set trust_remote_code: true if you trust that code"
    )
