"""Callbacks: the library API's public hook on a run's metrics, evaluations and saves (TRL's callbacks).

``GRPOTrainer(..., callbacks=[cb])`` (``PPOTrainer`` and ``DPOTrainer`` too) or
``trainer.add_callback(cb)``; a callback is any object with one or more of these methods (subclass
:class:`TrainerCallback` to write only those it needs)::

    on_step_end(step, metrics)   after each step: its metrics (what metrics.jsonl gets), a copy
    on_evaluate(step, metrics)   after each held-out evaluation (before the first step, every
                                 eval.every steps, at the end): its summary, flat (``eval/mean_words``,
                                 ``eval/rewards/<spec>``, ``eval/pass@1`` ...), numbers only
    on_save(step, path)          after a checkpoint (save_every), the final model, trainer.save(path)

They run in the caller's thread, between steps (a step's callbacks before its ``StepResult`` is
handed out), in the order they were added. A callback that raises is logged with its traceback and
the run goes on: a hook never stops training (Ctrl-C, a ``KeyboardInterrupt``, still does).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HOOKS = ("on_step_end", "on_evaluate", "on_save")


class TrainerCallback:
    """A callback that does nothing until a method is overridden."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """After step ``step``, with its metrics."""

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        """After a held-out evaluation at step ``step``, with its summary."""

    def on_save(self, step: int, path: Path) -> None:
        """After the model or a checkpoint was saved in ``path`` at step ``step``."""


def eval_metrics(summary: Mapping[str, Any], prefix: str = "eval") -> dict[str, float]:
    """An evaluation's summary flattened to ``{"eval/mean_words": ..., "eval/rewards/<spec>": ...}``
    (numbers only; nested sections joined with ``/``)."""
    flat: dict[str, float] = {}
    for key, value in summary.items():
        name = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            flat.update(eval_metrics(value, name))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


class Callbacks:
    """A run's callbacks, each hook called on every one, none allowed to stop the run."""

    def __init__(self, callbacks: Iterable[Any] = ()) -> None:
        self.callbacks: list[Any] = []
        for callback in callbacks:
            self.add(callback)

    def add(self, callback: Any) -> None:
        """Add ``callback`` (an object with at least one of :data:`HOOKS`; a class is instantiated)."""
        if isinstance(callback, type):
            callback = callback()
        if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
            raise TypeError(
                f"a callback has at least one of the methods {', '.join(HOOKS)}; "
                f"got a {type(callback).__name__}"
            )
        self.callbacks.append(callback)

    def step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        self._call("on_step_end", step, dict(metrics))

    def evaluate(self, step: int, summary: Mapping[str, Any]) -> None:
        self._call("on_evaluate", step, eval_metrics(summary))

    def save(self, step: int, path: Path) -> None:
        self._call("on_save", step, Path(path))

    def _call(self, hook: str, step: int, value: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if not callable(method):
                continue
            try:
                method(step, value.copy() if isinstance(value, dict) else value)  # each its own copy
            except Exception:  # noqa: BLE001 - the user's code: logged, and the run goes on
                logger.exception("callback %s.%s raised at step %d; the run goes on", type(callback).__name__,
                                 hook, step)  # fmt: skip

    def __len__(self) -> int:
        return len(self.callbacks)
