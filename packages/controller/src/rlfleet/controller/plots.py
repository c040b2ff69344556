"""PNG plots of runs: per-step metrics from ``metrics.jsonl``, held-out evals from ``eval.jsonl``.

Every run writes them to ``output_dir/plots`` when it finishes (:func:`write_run_plots`; a plot
that fails only logs a warning), and ``rlfleet plot RUN_DIR [RUN_DIR ...] [--out DIR]`` redraws
them, one line per run when several are given (overlays). The figures, each drawn when some run
logged its metrics:

- ``reward.png``: ``reward/mean``, and ``reward_components.png`` each ``reward/<component>``; a
  dashed line marks each step where the reward changed (a switch or a reward model swap mid-run:
  ``reward/spec_version_changed``, or a new ``reward/spec_revision``);
- ``response_length.png`` (``response_length``, tokens), ``entropy.png``, ``loss.png``;
- ``kl.png``: ``kl``, the KL to the reference model, drawn only when the run measured it (a run
  with KL off has none); ``policy_drift.png``: ``approx_kl``, how far the update moved the policy
  from the one that generated (never labelled KL: it is no KL penalty);
- ``step_time.png`` (``time/step_s``) and ``step_phases.png``: each step's time stacked by phase
  (waiting for its rollouts, training, publishing the weights: together the step's time);
- DPO: ``dpo_accuracy.png`` (``dpo/accuracy``) and ``dpo_margin.png`` (``dpo/margin``, with the
  chosen and rejected implicit rewards);
- ``eval.png``: the held-out mean words, share within the limit, similarity (MiniLM cosine of
  question and answer; older files' ``relevance``) and reward at each evaluation (before the first
  step, every ``eval.every`` steps, at the end).

matplotlib is imported when a plot is drawn (Agg backend: no display needed).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlfleet.common.errors import ConfigError
from rlfleet.controller.eval_metrics import SIMILARITY, summary_similarity

logger = logging.getLogger(__name__)

Series = dict[str, list[tuple[int, float]]]
"""Metric name -> (step, value) points of one run."""

PANELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward": ("reward (mean)", ("reward/mean",)),
    "response_length": ("response length (tokens)", ("response_length",)),
    "kl": ("KL to the reference model", ("kl",)),
    "policy_drift": ("policy drift (approx_kl: the update against the generating policy)", ("approx_kl",)),
    "entropy": ("entropy", ("entropy",)),
    "loss": ("loss", ("loss",)),
    "step_time": ("step time (s)", ("time/step_s",)),
    "dpo_accuracy": ("DPO accuracy (chosen reward > rejected)", ("dpo/accuracy",)),
    "dpo_margin": ("DPO implicit rewards", ("dpo/margin", "dpo/chosen_reward", "dpo/rejected_reward")),
}
"""File stem -> (title, metric names drawn in it)."""
REWARD_STATS = frozenset({"mean", "std", "max", "min", "raw_mean", "spec_revision", "spec_version_changed",
                          "spec_versions_in_step"})  # fmt: skip
"""``reward/<name>`` metrics that are statistics of the total, not components."""
EVAL_METRICS = (("mean_words", "mean words"), ("within_limit", "share within limit"),
                ("similarity", "similarity"), ("reward", "reward"))  # fmt: skip
STEP_PHASES = (("time/rollout_wait_s", "waiting for rollouts"), ("time/train_s", "training"),
               ("time/publish_s", "publishing weights"))  # fmt: skip
"""The phases of a step, in order; their times add up to ``time/step_s`` (online.py)."""
REWARD_MARKED = frozenset({"reward", "reward_components"})
"""The figures where a reward change is marked."""


def read_metrics(path: Path) -> Series:
    """Each numeric metric of ``metrics.jsonl`` as (step, value) points; ConfigError on a bad line."""
    series: Series = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError("metrics", str(path), f"unreadable: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError("metrics", f"{path}:{number}", f"not a JSON line ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ConfigError(
                "metrics", f"{path}:{number}", "not a metrics line (an object with an integer step)"
            )
        for name, value in record.items():
            number_value = _number(value)
            if name not in ("step", "time") and number_value is not None:
                series.setdefault(name, []).append((record["step"], number_value))
    return series


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if value in ("NaN", "Infinity", "-Infinity"):  # how metrics.jsonl writes non-finite values
        return float(value.lower().replace("infinity", "inf"))
    return None


def read_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The held-out evaluations of a run (``eval.jsonl``: label, step, summary); none without the file."""
    path = run_dir / "eval.jsonl"
    if not path.is_file():
        return []
    evals = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            record = json.loads(line)
            evals.append(
                {
                    "label": str(record["label"]),
                    "step": int(record["step"]),
                    "summary": dict(record["summary"]),
                }
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError("eval", f"{path}:{number}", f"not an eval line ({exc})") from None
    return evals


def check_run_dir(run_dir: Path) -> Path:
    """``run_dir/metrics.jsonl``, or a ConfigError saying what is missing."""
    if not run_dir.is_dir():
        raise ConfigError("run", str(run_dir), "no such directory")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(
            "run", str(run_dir), "holds no metrics.jsonl: is it a run's output_dir (loggers: jsonl)?"
        )
    return path


def _figure(title: str) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    _axes(ax, title)
    return fig, ax


def _axes(ax: Any, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def _lines(ax: Any, runs: Sequence[tuple[str, Series]], names: Sequence[str]) -> int:
    """Draw each run's ``names``; how many lines were drawn."""
    drawn = 0
    for label, series in runs:
        for name in names:
            points = [(s, v) for s, v in series.get(name, []) if math.isfinite(v)]
            if points:
                tag = name if len(runs) == 1 else f"{label}: {name}"
                marker = "." if len(points) < 30 else None
                ax.plot([s for s, _ in points], [v for _, v in points], marker=marker, label=tag)
                drawn += 1
    return drawn


def plot_runs(run_dirs: Sequence[Path], out_dir: Path, labels: Sequence[str] | None = None) -> list[Path]:
    """Draw every figure some run has data for into ``out_dir``; the PNG files written."""
    labels = list(labels) if labels is not None else _labels(run_dirs)
    runs = [(label, read_metrics(check_run_dir(d))) for label, d in zip(labels, run_dirs, strict=True)]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    components = sorted({n for _, s in runs for n in s if n.startswith("reward/")
                         and n.split("/", 1)[1] not in REWARD_STATS})  # fmt: skip
    panels = dict(PANELS)
    if components:
        panels["reward_components"] = ("reward components", tuple(components))
    for stem, (title, names) in panels.items():
        fig, ax = _figure(title)
        if _lines(ax, runs, names):
            if stem in REWARD_MARKED:
                _mark_reward_changes(ax, runs)
            ax.legend(fontsize="small")
            written.append(_save(fig, out_dir / f"{stem}.png"))
        else:
            _close(fig)
    phased = [(label, series) for label, series in runs if any(name in series for name, _ in STEP_PHASES)]
    if phased:
        written.append(_plot_phases(phased, out_dir / "step_phases.png"))
    evals = [(label, read_evals(d)) for label, d in zip(labels, run_dirs, strict=True)]
    if any(records for _, records in evals):
        written.append(_plot_evals(evals, out_dir / "eval.png"))
    return written


def reward_changes(series: Series) -> list[int]:
    """Steps whose scores came from a reward other than the step before's: a step logged
    ``reward/spec_version_changed`` 1, or a ``reward/spec_revision`` unlike the one before."""
    steps = {step for step, value in series.get("reward/spec_version_changed", []) if value > 0}
    revisions = series.get("reward/spec_revision", [])
    steps.update(
        step for (_, before), (step, now) in zip(revisions, revisions[1:], strict=False) if now != before
    )
    return sorted(steps)


def _mark_reward_changes(ax: Any, runs: Sequence[tuple[str, Series]]) -> None:
    """A dashed vertical line at each step where a run's reward changed (one legend entry a run)."""
    for label, series in runs:
        name = "reward changed" if len(runs) == 1 else f"{label}: reward changed"
        for n, step in enumerate(reward_changes(series)):
            ax.axvline(step, color="grey", linestyle="--", linewidth=1, label=name if n == 0 else None)


def step_phases(series: Series) -> tuple[list[int], dict[str, list[float]]]:
    """Each step's time by phase (:data:`STEP_PHASES`), and ``other``: what the step's total holds
    beyond them (none in an online step; a step without phases, DPO's, is all ``other``)."""
    by_step: dict[int, dict[str, float]] = {}
    for name, _ in (*STEP_PHASES, ("time/step_s", "")):
        for step, value in series.get(name, []):
            if math.isfinite(value):
                by_step.setdefault(step, {})[name] = value
    steps = sorted(s for s, values in by_step.items() if any(n in values for n, _ in STEP_PHASES))
    phases: dict[str, list[float]] = {title: [] for _, title in STEP_PHASES}
    phases["other"] = []
    for step in steps:
        values = by_step[step]
        parts = [max(0.0, values.get(name, 0.0)) for name, _ in STEP_PHASES]
        for (_, title), part in zip(STEP_PHASES, parts, strict=True):
            phases[title].append(part)
        phases["other"].append(max(0.0, values.get("time/step_s", sum(parts)) - sum(parts)))
    return steps, phases


def _plot_phases(runs: Sequence[tuple[str, Series]], path: Path) -> Path:
    """Step time stacked by phase, one panel per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4), dpi=100, squeeze=False)
    for ax, (label, series) in zip(axes[0], runs, strict=True):
        _axes(ax, "step time by phase (s)" if len(runs) == 1 else f"{label}: step time by phase (s)")
        steps, phases = step_phases(series)
        shown = {title: values for title, values in phases.items() if any(v > 0 for v in values)}
        if steps and shown:
            ax.stackplot(steps, *shown.values(), labels=list(shown), alpha=0.8)
            ax.legend(fontsize="small", loc="upper left")
    return _save(fig, path)


def _plot_evals(evals: Sequence[tuple[str, list[dict[str, Any]]]], path: Path) -> Path:
    """Held-out metrics at each evaluation, one panel per metric, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(EVAL_METRICS), figsize=(4 * len(EVAL_METRICS), 3.6), dpi=100)
    for ax, (key, title) in zip(axes, EVAL_METRICS, strict=True):
        _axes(ax, f"held-out {title}")
        for label, records in evals:
            points = [(r["step"], _eval_value(r["summary"], key)) for r in records]
            points = [(s, v) for s, v in points if v is not None]
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label=label)
        if ax.lines:
            ax.legend(fontsize="small")
    return _save(fig, path)


def _eval_value(summary: dict[str, Any], key: str) -> float | None:
    if key == SIMILARITY:
        return summary_similarity(summary)  # an older eval.jsonl calls it relevance
    if key == "reward":
        values = list(summary.get("rewards", {}).values())
        return values[0] if values else None
    value = summary.get(key)
    return float(value) if isinstance(value, int | float) else None


def _close(fig: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's folder name; the whole path where names repeat."""
    names = [d.resolve().name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def write_run_plots(output_dir: Path, say: Callable[[str], None] | None = None) -> list[Path]:
    """A finished run's plots into ``output_dir/plots``; a failure is logged, never raised."""
    try:
        written = plot_runs([output_dir], output_dir / "plots")
    except Exception as exc:  # noqa: BLE001 - plots are a by-product: they must never fail a run
        logger.warning("could not draw the run's plots in %s: %s", output_dir / "plots", exc)
        return []
    if say is not None and written:
        say(f"plots written to {output_dir / 'plots'} ({', '.join(p.name for p in written)})")
    return written


def add_plot_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plot", help="draw (and overlay) the PNG plots of one or more runs")
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="a run's output_dir (metrics.jsonl)")
    where = "folder for the PNGs (default: RUN_DIR/plots for one run, ./plots for several)"
    p.add_argument("--out", type=Path, default=None, help=where)
    p.add_argument("--log-level", default="WARNING", help="log level (default WARNING)")
    p.set_defaults(handler=run_plot_command)


def run_plot_command(args: argparse.Namespace) -> int:
    """``rlfleet plot``: the PNGs written, one a line; a bad run directory raises ConfigError (exit 2)."""
    runs = list(args.runs)
    out = args.out if args.out is not None else (runs[0] / "plots" if len(runs) == 1 else Path("plots"))
    written = plot_runs(runs, out)
    if not written:
        raise ConfigError("run", ", ".join(map(str, runs)), "no plottable metrics in metrics.jsonl")
    for path in written:
        print(path)
    return 0
