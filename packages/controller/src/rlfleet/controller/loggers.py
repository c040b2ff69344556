"""Metric sinks: console progress, metrics.jsonl, TensorBoard and Weights & Biases.

Chosen by ``TrainerConfig.loggers``; each sink gets every step's flat ``{name: float}`` dict. A run
holds one :class:`RunMetrics` (its sinks and progress bar).

A non-finite metric (a step whose gradient overflowed: the trainer skipped its update) is shown,
never hidden: ``metrics.jsonl`` writes it as the string ``"NaN"``, ``"Infinity"`` or
``"-Infinity"`` (JSON has no such numbers; the control plane writes them the same way),
TensorBoard and W&B get the float, the ``[PROGRESS]`` line prints ``nan``/``inf``, and the console
says which metrics were not finite and whether the update was skipped (:func:`nonfinite_line`).
A metric a step did not produce reads ``n/a``.

A run resumed from a checkpoint (``resume_from``) continues the history in the same folder: each
sink keeps the steps up to the checkpoint's and drops the stopped run's later ones, which are run
again (:meth:`RunMetrics.begin`'s ``from_step``); W&B starts a new run.

A run that goes back (a crashed trainer restored from a checkpoint runs the steps after it again,
:mod:`rlfleet.controller.supervision`) logs a step it logged before. Every sink ends with each step
once, the replay's: ``metrics.jsonl`` drops its lines from that step on (rewritten atomically)
before the step is written again; TensorBoard opens a new event file with ``purge_step`` (it hides
the earlier events from that step on); W&B, whose steps only go up, keeps the first run's values
and skips the replay. :meth:`RunMetrics.rewind` does the same ahead of the replay.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from rlfleet.common.atomic_files import write_atomic
from rlfleet.controller.errors import LoggerUnavailable

logger = logging.getLogger(__name__)


class MetricSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def rewind(self, step: int) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per step in ``metrics.jsonl``: ``step``, ``time`` (when the step ended, seconds
    since the epoch) and the step's metrics. A new run replaces the file; a run resumed at step
    ``from_step`` keeps the lines of the steps up to it and drops the later ones (run again), as
    :meth:`rewind` does. A step logged again replaces its line and every later one, so the file
    holds each step once."""

    def __init__(self, output_dir: Path, from_step: int = 0) -> None:
        self.path = output_dir / "metrics.jsonl"
        self._last = -1  # the highest step written
        if from_step > 0 and self.path.is_file():
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run
            self._last = sys.maxsize  # whatever the stopped run wrote after from_step goes
            self.rewind(from_step)
        else:
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - kept open for the run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self._last:
            self.rewind(step - 1)
        clean = {k: json_number(v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, "time": round(time.time(), 3), **clean}) + "\n")
        self._file.flush()
        self._last = step

    def rewind(self, step: int) -> None:
        """Drop the lines of the steps after ``step``: the file is rewritten atomically (a crash
        leaves the old file or the new one), then appended to."""
        if step >= self._last:
            return
        self._file.close()
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True)
                if line.strip() and _step_of(line) <= step]  # fmt: skip
        write_atomic(self.path, "".join(kept))
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run
        logger.info("metrics.jsonl rewound to step %d (%d lines kept)", step, len(kept))
        self._last = step

    def close(self) -> None:
        self._file.close()


def _step_of(line: str) -> int:
    """The ``step`` of one ``metrics.jsonl`` line (a line that is not one counts as after every step)."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return sys.maxsize
    return step if isinstance(step, int) else sys.maxsize


class TensorBoardSink:
    """Scalars into TensorBoard event files under ``output_dir/tensorboard``. A step logged again
    opens a new event file with ``purge_step``: TensorBoard hides what the earlier files hold from
    that step on, so each step shows once. A run resumed at step ``from_step`` opens its file with
    ``purge_step = from_step + 1``: the stopped run's steps up to the checkpoint stay, its later
    ones (run again) are hidden."""

    def __init__(self, output_dir: Path, from_step: int = 0) -> None:
        self._log_dir = str(output_dir / "tensorboard")
        self._writer = self._open(purge_step=from_step + 1 if from_step > 0 else None)
        self._last = from_step if from_step > 0 else -1

    def _open(self, purge_step: int | None = None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=self._log_dir, purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self._last:
            self.rewind(step - 1)
        for name, value in metrics.items():
            if isinstance(value, (int, float)):  # NaN and inf too: TensorBoard plots them as such
                self._writer.add_scalar(name, value, step)
        self._writer.flush()
        self._last = step

    def rewind(self, step: int) -> None:
        """Hide the events of the steps after ``step`` (a new writer purging from ``step + 1``)."""
        if step >= self._last:
            return
        self._writer.close()
        self._writer = self._open(purge_step=step + 1)
        self._last = step

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases, when installed (``WANDB_MODE=offline`` works without a network)."""

    def __init__(self, output_dir: Path, config: dict[str, Any], project: str = "rlfleet") -> None:
        try:
            import wandb
        except ImportError as exc:
            raise LoggerUnavailable("wandb", "wandb") from exc
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", project), dir=str(output_dir),
                               config=config)  # fmt: skip
        self._last = -1

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self._last:  # W&B steps only go up: the first run of a replayed step stays
            logger.info("W&B keeps step %d as first logged (a replayed step is not sent)", step)
            return
        self._run.log(metrics, step=step)
        self._last = step

    def rewind(self, step: int) -> None:
        """Nothing to drop: W&B cannot go back; the replayed steps are skipped in :meth:`log`."""

    def close(self) -> None:
        self._run.finish()


class ConsoleProgress:
    """A progress bar plus a ``[PROGRESS]`` line every ``log_every`` steps."""

    def __init__(
        self, total_steps: int, num_epochs: int, log_every: int, enabled: bool = True, kl_off: bool = False
    ) -> None:
        from tqdm import tqdm

        self.kl_off = kl_off
        self.total_steps = total_steps
        self.num_epochs = num_epochs
        self.log_every = log_every
        self.enabled = enabled
        self._bar = tqdm(total=total_steps, desc="train", unit="step", file=sys.stderr, disable=not enabled,
                         dynamic_ncols=True, leave=False)  # fmt: skip

    def update(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._bar.update(1)
        self._bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
        if step % self.log_every == 0 or step == self.total_steps:
            self.write(
                progress_line(epoch, self.num_epochs, step, self.total_steps, metrics, kl_off=self.kl_off)
            )

    def write(self, text: str) -> None:
        if self.enabled:
            self._bar.clear()
            print(text, flush=True)
            self._bar.refresh()
        else:
            print(text, flush=True)

    def close(self) -> None:
        self._bar.close()


def progress_line(
    epoch: int, num_epochs: int, step: int, total: int, metrics: dict[str, float], *, kl_off: bool = False
) -> str:
    """``[PROGRESS] Epoch 1/3 | Step 100/1200 | Loss: 2.14 | Reward: 4.21 | KL: 0.087 | Len: 11.5``.

    A value the step did not produce reads ``n/a``; ``KL`` reads ``off`` in a run without a KL term
    (``kl_off``: no reference model).
    """
    kl = "off" if kl_off and "kl" not in metrics else _num(metrics, "kl")
    return (
        f"[PROGRESS] Epoch {epoch}/{num_epochs} | Step {step}/{total} | Loss: {_num(metrics, 'loss')} | "
        f"Reward: {_num(metrics, 'reward/mean')} | KL: {kl} | "
        f"Len: {_num(metrics, 'response_length', '.1f')}"
    )


def _num(metrics: dict[str, float], name: str, spec: str = ".3g") -> str:
    value = metrics.get(name)
    if not isinstance(value, (int, float)):
        return "n/a"
    return format(value, spec)  # nan, inf and -inf read as such


NONFINITE_TEXT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
"""How ``metrics.jsonl`` (and the wire) write a non-finite float: a JSON string."""


def json_number(value: object) -> float | str | None:
    """``value`` for a JSON file: a finite number as is, NaN/inf as ``"NaN"``/``"Infinity"``/
    ``"-Infinity"``, anything that is no number as null."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if math.isfinite(value):
        return value
    return NONFINITE_TEXT[str(float(value))]


def nonfinite_line(step: int, metrics: dict[str, float]) -> str | None:
    """A ``[WARNING]`` line naming the step's non-finite metrics, or None when every one is finite.

    ``update_skipped`` (the fraction of the step's optimizer steps the trainer skipped) says whether
    the parameters moved: ``[WARNING] Step 7: not finite: grad_norm=inf, loss=nan; the trainer
    skipped the update (update_skipped=1)``.
    """
    bad = [f"{k}={v}" for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return None
    skipped = [v for k, v in metrics.items() if k.endswith("update_skipped") and isinstance(v, (int, float))]
    outcome = ""
    if skipped and max(skipped) > 0:
        outcome = f"; the trainer skipped the update (update_skipped={max(skipped):g})"
    elif skipped:
        outcome = "; the update was applied"
    return f"[WARNING] Step {step}: not finite: {', '.join(bad)}{outcome}"


# logger name -> the package it needs (console, jsonl and tensorboard come with the controller)
OPTIONAL_PACKAGES: dict[str, str] = {"wandb": "wandb"}


def check_loggers(names: list[str]) -> None:
    """Raise :class:`LoggerUnavailable` now, before a fleet starts, if a selected logger cannot run."""
    for name in names:
        package = OPTIONAL_PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise LoggerUnavailable(name, package)


def make_sinks(
    names: list[str], output_dir: Path, config: dict[str, Any], from_step: int = 0
) -> list[MetricSink]:
    """The sinks named in the config ('console' is handled by ConsoleProgress), for a run that
    starts after step ``from_step`` (0: a new run; else resumed from that step's checkpoint)."""
    sinks: list[MetricSink] = []
    for name in names:
        if name == "jsonl":
            sinks.append(JsonlSink(output_dir, from_step))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(output_dir, from_step))
        elif name == "wandb":
            sinks.append(WandbSink(output_dir, config))
    return sinks


class RunMetrics:
    """A run's metric sinks and console progress, opened at the first step, closed with the run."""

    def __init__(
        self,
        loggers: list[str],
        output_dir: Path,
        config: dict[str, Any],
        log_every: int,
        *,
        kl_off: bool = False,
    ) -> None:
        check_loggers(loggers)  # before anything starts: a missing package fails in a second
        self.kl_off = kl_off  # the run has no KL term: the progress line says KL: off
        self.loggers = list(loggers)
        self.output_dir = output_dir
        self.config = config
        self.log_every = log_every
        self._sinks: list[MetricSink] = []
        self._progress: ConsoleProgress | None = None

    def begin(self, total_steps: int, num_epochs: int, from_step: int = 0) -> None:
        """Open the sinks (once) for a run of ``total_steps`` over ``num_epochs`` that goes on after
        step ``from_step`` (a resumed run: ``metrics.jsonl`` keeps the steps up to it)."""
        if self._progress is None:
            enabled = "console" in self.loggers
            self._progress = ConsoleProgress(
                total_steps, num_epochs, self.log_every, enabled=enabled, kl_off=self.kl_off
            )
            self._sinks = make_sinks(self.loggers, self.output_dir, self.config, from_step)

    def log(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        """One step's metrics to every sink and the progress line."""
        for sink in self._sinks:
            sink.log(step, metrics)
        if self._progress is not None:
            self._progress.update(step, epoch, metrics)
        warning = nonfinite_line(step, metrics)
        if warning is not None:
            self.say(warning)

    def rewind(self, step: int) -> None:
        """The run went back to ``step`` (a trainer restored from ``checkpoint-<step>``): every sink
        drops what it holds of later steps, which are logged again as they run."""
        for sink in self._sinks:
            sink.rewind(step)

    def say(self, text: str) -> None:
        """Print ``text`` without breaking the progress bar."""
        if self._progress is not None:
            self._progress.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Close the sinks and the progress bar (idempotent)."""
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        if self._progress is not None:
            self._progress.close()
            self._progress = None
