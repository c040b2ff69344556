"""``rlfleet train examples/tiny_ppo.yaml`` and ``examples/tiny_dpo.yaml`` through real processes.

The CLI runs as a subprocess and starts a private nats-server and the workers each algorithm
needs: PPO the trainer (actor, reference and critic), reward and rollout workers; DPO the trainer
alone. The tests check that the metric each example promises improves (PPO: the reward; DPO: the
preference accuracy and margin), what lands in ``output_dir``, and that every process is gone.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _rows(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_tiny_ppo_example_raises_the_reward(
    tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    out, steps = tmp_path / "ppo", 12
    example = str(REPO / "examples" / "tiny_ppo.yaml")
    overrides = [f"max_steps={steps}", f"output_dir={out}", "log_every=4", "sample_table_size=0"]
    command = [venv_script("rlfleet"), "train", example, *overrides]
    run = subprocess.run(command, cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=450)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(out)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert [row["weight_version"] for row in rows] == list(range(1, steps + 1))
    rewards = [row["reward/mean"] for row in rows]
    assert statistics.fmean(rewards[-3:]) > statistics.fmean(rewards[:3]) + 0.1, (
        f"reward did not rise: {rewards}"
    )
    last = rows[-1]
    for key in (
        "critic/explained_variance",
        "critic/vf_loss",
        "clip_frac",
        "approx_kl",
        "entropy",
        "kl_reward",
    ):
        assert key in last, key
    assert last["kl"] > 0 and "kl_loss" not in last  # PPO's KL sits in the reward
    assert (out / "final" / "config.json").is_file()
    workers = procs.launched(out)
    assert {"trainer-0", "reward-0", "rollout-0"} <= workers.keys()
    assert procs.survivors(workers) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_dpo_example_raises_preference_accuracy(
    tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    out = tmp_path / "dpo"
    command = [venv_script("rlfleet"), "train", str(REPO / "examples" / "tiny_dpo.yaml"), f"output_dir={out}"]
    run = subprocess.run(command, cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[PROGRESS]" in run.stdout
    rows = _rows(out)
    assert len(rows) == 16  # 256 pairs / 32 per step, 2 epochs
    accuracy, margin = [row["dpo/accuracy"] for row in rows], [row["dpo/margin"] for row in rows]
    assert rows[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy starts as its reference
    assert statistics.fmean(accuracy[-4:]) > accuracy[0] + 0.5, accuracy
    assert margin[-1] > margin[0] + 0.3 and rows[-1]["loss"] < rows[0]["loss"] - 0.1, margin
    assert {"dpo/chosen_reward", "dpo/rejected_reward"} <= rows[-1].keys()
    assert (out / "final" / "config.json").is_file()
    workers = procs.launched(out)
    assert set(workers) == {"trainer-0", "nats-server"}  # neither rollout nor reward workers
    assert procs.survivors(workers) == []
