"""The plots a run leaves (issue 35, point 7), drawn from metrics files written here: the KL panel
only for a reference KL (the policy drift is its own, never called KL), similarity (old files'
relevance) in the eval figure, the step time by phase, a marker where the reward changed, DPO's
loss, accuracy and margin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlfleet.controller.plots import plot_runs, read_metrics, reward_changes, step_phases

pytest.importorskip("matplotlib")


def _run(path: Path, steps: list[dict[str, Any]], evals: list[dict[str, Any]] = ()) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, **m}) + "\n" for i, m in enumerate(steps))
    )
    if evals:
        (path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return path


def _grpo_step(i: int, **extra: float) -> dict[str, float]:
    return {"loss": 0.1 * i, "reward/mean": 0.2 * i, "approx_kl": 0.01 * i, "time/rollout_wait_s": 2.0,
            "time/train_s": 1.0 + i, "time/publish_s": 0.5, "time/step_s": 3.5 + i, **extra}  # fmt: skip


def test_kl_off_draws_the_policy_drift_under_its_own_name(tmp_path: Path) -> None:
    run = _run(tmp_path / "run", [_grpo_step(i) for i in range(1, 5)])
    names = {p.name for p in plot_runs([run], tmp_path / "plots")}
    assert "policy_drift.png" in names and "kl.png" not in names, names
    with_kl = _run(tmp_path / "kl-run", [_grpo_step(i, kl=0.02 * i) for i in range(1, 5)])
    names = {p.name for p in plot_runs([with_kl], tmp_path / "kl-plots")}
    assert {"kl.png", "policy_drift.png"} <= names


def test_step_time_is_broken_down_by_phase(tmp_path: Path) -> None:
    steps = [_grpo_step(i) for i in range(1, 4)]
    steps[2]["time/step_s"] = 9.0  # 2.5 s the phases do not hold
    run = _run(tmp_path / "run", steps)
    assert (tmp_path / "plots" / "step_phases.png") in plot_runs([run], tmp_path / "plots")
    at, phases = step_phases(read_metrics(run / "metrics.jsonl"))
    assert at == [1, 2, 3]
    assert phases["waiting for rollouts"] == [2.0, 2.0, 2.0] and phases["training"] == [2.0, 3.0, 4.0]
    assert phases["publishing weights"] == [0.5, 0.5, 0.5] and phases["other"] == [0.0, 0.0, 2.5]
    dpo = _run(tmp_path / "dpo", [{"loss": 0.6, "time/step_s": 1.0}])
    assert "step_phases.png" not in {p.name for p in plot_runs([dpo], tmp_path / "dpo-plots")}


def test_a_reward_change_is_found_and_marked(tmp_path: Path) -> None:
    steps = [_grpo_step(i, **{"reward/spec_revision": 1.0 if i < 3 else 2.0,
                              "reward/spec_version_changed": 1.0 if i == 3 else 0.0,
                              "reward/concise": 0.1 * i}) for i in range(1, 6)]  # fmt: skip
    run = _run(tmp_path / "run", steps)
    assert reward_changes(read_metrics(run / "metrics.jsonl")) == [3]
    python_scorer = {"reward/spec_revision": [(1, 1.0), (2, 1.0), (3, 4.0), (4, 4.0)]}  # no changed flag
    assert reward_changes(python_scorer) == [3]
    assert reward_changes({"reward/mean": [(1, 0.0)]}) == []
    import matplotlib

    matplotlib.use("Agg")
    drawn: list[Any] = []
    from matplotlib.axes import Axes

    original = Axes.axvline

    def spy(self: Axes, x: float = 0, *args: Any, **kwargs: Any) -> Any:
        drawn.append((self.get_title(), x, kwargs.get("label")))
        return original(self, x, *args, **kwargs)

    Axes.axvline = spy  # type: ignore[method-assign]
    try:
        plot_runs([run], tmp_path / "plots")
    finally:
        Axes.axvline = original  # type: ignore[method-assign]
    assert ("reward (mean)", 3, "reward changed") in drawn
    assert ("reward components", 3, "reward changed") in drawn


def test_dpo_runs_get_loss_accuracy_and_margin(tmp_path: Path) -> None:
    steps = [{"loss": 0.69 - 0.1 * i, "dpo/accuracy": 0.5 + 0.1 * i, "dpo/margin": 0.2 * i,
              "dpo/chosen_reward": 0.1 * i, "dpo/rejected_reward": -0.1 * i, "time/step_s": 1.0}
             for i in range(4)]  # fmt: skip
    names = {p.name for p in plot_runs([_run(tmp_path / "dpo", steps)], tmp_path / "plots")}
    assert {"loss.png", "dpo_accuracy.png", "dpo_margin.png"} <= names, names
    assert not names & {"kl.png", "policy_drift.png", "reward.png"}


def test_the_eval_figure_says_similarity_and_reads_old_files(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    old = {
        "label": "before",
        "step": 0,
        "summary": {"mean_words": 9.0, "within_limit": 1.0, "relevance": 0.4},
    }
    new = {
        "label": "after",
        "step": 2,
        "summary": {"mean_words": 5.0, "within_limit": 1.0, "similarity": 0.6},
    }
    run = _run(tmp_path / "run", [_grpo_step(1), _grpo_step(2)], [old, new])
    plotted: dict[str, list[float]] = {}
    original = Axes.plot

    def spy(self: Axes, *args: Any, **kwargs: Any) -> Any:
        if len(args) >= 2:
            plotted[self.get_title()] = list(args[1])
        return original(self, *args, **kwargs)

    Axes.plot = spy  # type: ignore[method-assign]
    try:
        assert (tmp_path / "plots" / "eval.png") in plot_runs([run], tmp_path / "plots")
    finally:
        Axes.plot = original  # type: ignore[method-assign]
    assert plotted["held-out similarity"] == [0.4, 0.6]
    assert not any("relevance" in title for title in plotted)
