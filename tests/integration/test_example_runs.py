"""The example jobs beyond GRPO, each run as ``rlfleet train examples/<job>.yaml`` through real processes.

Each CLI runs as a subprocess from the repository root (as the jobs' comments say) and starts a
private nats-server plus trainer, reward and rollout workers. ``tiny_rloo`` and
``tiny_reinforce_pp``: the reward rises over a dozen steps (the policy learns to answer with
digits) and each algorithm's KL lands where it belongs (RLOO's example runs without one;
REINFORCE++ puts k1 into the token rewards). ``tiny_ppo_rm``: the reward is the committed tiny
reward model's score (``reward/rm``, a model endpoint on the reward tier), the critic trains and
the model's reward rises. ``gsm8k_numeric``: both components of its spec score every rollout,
``numeric`` reading each generated problem's ``answer``. Every process a run started is gone.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _train(
    job: str, out: Path, steps: int, venv_script: Any, cli_env: dict[str, str], procs: Any
) -> list[dict]:
    """Run ``examples/<job>.yaml`` for ``steps`` steps, check that it ended well; its metrics rows."""
    overrides = [f"max_steps={steps}", f"output_dir={out}", "log_every=4", "sample_table_size=0"]
    command = [venv_script("rlfleet"), "train", str(REPO / "examples" / f"{job}.yaml"), *overrides]
    run = subprocess.run(command, cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=450)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[PROGRESS]" in run.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert [row["weight_version"] for row in rows] == list(range(1, steps + 1)), "one publish per step"
    assert (out / "final" / "config.json").is_file()
    workers = procs.launched(out)
    assert {"trainer-0", "reward-0", "rollout-0"} <= workers.keys()
    assert procs.survivors(workers) == []
    return rows


def _assert_reward_rises(rows: list[dict]) -> None:
    rewards = [row["reward/mean"] for row in rows]
    assert statistics.fmean(rewards[-3:]) > statistics.fmean(rewards[:3]) + 0.1, f"no rise: {rewards}"


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("algorithm", ["rloo", "reinforce_pp"])
def test_tiny_example_raises_the_reward(
    algorithm: str, tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    rows = _train(f"tiny_{algorithm}", tmp_path / algorithm, 12, venv_script, cli_env, procs)
    _assert_reward_rises(rows)
    assert rows[-1]["reward/charset"] == pytest.approx(rows[-1]["reward/mean"])
    if algorithm == "rloo":  # kl_coef 0: no reference, no KL anywhere
        assert "kl" not in rows[-1] and "kl_reward" not in rows[-1]
    else:
        assert rows[-1]["kl"] > 0 and "kl_reward" in rows[-1] and "kl_loss" not in rows[-1]
    assert "critic/vf_loss" not in rows[-1]  # neither trains a critic


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("recipe", ["dapo_tiny", "gspo_tiny", "dr_grpo_tiny"])
def test_a_recipe_raises_the_reward(
    recipe: str, tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    """Issue 31's recipes, each what its file says it changes against GRPO, as the trainer saw it."""
    rows = _train(recipe, tmp_path / recipe, 12, venv_script, cli_env, procs)
    _assert_reward_rises(rows)
    if recipe == "dapo_tiny":  # the soft overlong penalty reached the trainer and acted on every step
        assert all(row["overlong/penalty_mean"] < 0 and "overlong/truncated_frac" in row for row in rows)
        assert "overlong/masked_frac" not in rows[-1]
        # dynamic sampling: each step trained at most its batch of groups, taking another batch only
        # while it had fewer with a signal (early in the run a batch mostly has enough)
        for row in rows:
            assert row["groups/kept"] <= 16 and 1 <= row["rollout/batches_generated"] <= 3
            assert row["rollout/batches_generated"] > 1 or row["groups/kept"] == 16
    if recipe == "gspo_tiny":  # the second optimizer step's sequence ratios left the tight range
        assert max(row["clip_frac"] for row in rows) > 0
    assert "kl" not in rows[-1] and "critic/vf_loss" not in rows[-1]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_tiny_ppo_with_a_reward_model_trains(
    tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    rows = _train("tiny_ppo_rm", tmp_path / "ppo_rm", 12, venv_script, cli_env, procs)
    assert all(row["reward/rm"] == pytest.approx(row["reward/mean"]) for row in rows)
    assert all(-0.5 < row["reward/mean"] < 1.5 for row in rows)  # the model's scores lie near [0, 1]
    for key in ("critic/vf_loss", "critic/explained_variance", "kl_reward", "clip_frac"):
        assert all(key in row for row in rows), key
    _assert_reward_rises(rows)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("job", ["gsm8k_numeric", "dapo_gsm8k", "gspo_gsm8k", "dr_grpo_gsm8k"])
def test_gsm8k_numeric_example_scores_its_answers(
    job: str, tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    """The GSM8K-style job and its recipes (issue 31): both reward components score every answer;
    DAPO's filter drops the answers cut at the cap (the character model's, all of them) from the loss."""
    for row in _train(job, tmp_path / job, 2, venv_script, cli_env, procs):
        numeric, regex = row["reward/numeric"], row["reward/regex"]
        assert 0.0 <= numeric <= 1.0 and 0.0 <= regex <= 1.0, row
        assert row["reward/mean"] == pytest.approx(numeric + 0.1 * regex)
        batches = row.get("rollout/batches_generated", 1)  # dapo_gsm8k: dynamic sampling, up to 3
        assert row["rollout/samples"] == 32 * batches  # 8 problems x 4 samples a batch, all scored
        if job == "dapo_gsm8k":
            assert 1 <= batches <= 3 and row["groups/generated"] == 8 * batches
            assert (
                row["overlong/masked_frac"] == row["overlong/truncated_frac"]
                and "overlong/penalty_mean" in row
            )


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize(("job", "steps"), [("calculator_tiny", 36), ("guess_number_tiny", 24)])
def test_multi_turn_examples_raise_the_reward(
    job: str, steps: int, tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    """Issue 33: the tiny episode jobs (the run's reward worker serves the environment, the rollout
    worker drives the episodes, reward: episode) raise the environment's reward."""
    rows = _train(job, tmp_path / job, steps, venv_script, cli_env, procs)
    rewards = [row["reward/mean"] for row in rows]
    assert statistics.fmean(rewards[-6:]) > statistics.fmean(rewards[:6]) + 0.04, f"no rise: {rewards}"
    assert rows[-1]["reward/episode"] == pytest.approx(rows[-1]["reward/mean"])
    assert {"episode/turns_mean", "episode/tool_calls_mean", "episode/env_s_mean"} <= rows[-1].keys()
    if job == "guess_number_tiny":  # several turns, the feedback in the context and out of the loss
        assert rows[-1]["episode/turns_mean"] > 1.5 and rows[-1]["episode/masked_token_frac"] > 0.3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_trainer_trains_on_exactly_the_tokens_of_the_episodes(
    tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    """Token in, token out through real processes: in float32 the trainer's logprobs of the sampled
    tokens, each conditioned on the episode's context as the trainer rebuilds it from the batch
    (prompt, earlier turns, observations), equal the engine's to float rounding; a re-tokenised or
    misplaced observation would move them by far more. Under PPO (the batch and the forward are GRPO's;
    the tiny GRPO episode jobs above run in bf16): its critic values the episodes' tokens, GAE runs
    over the model's tokens with the observations masked out, and the policy moves."""
    overrides = ["model.mixed_precision=none", "max_steps=3", f"output_dir={tmp_path}", "sample_table_size=0",
                 "algorithm.name=ppo", "algorithm.critic_learning_rate=0.003"]  # fmt: skip
    command = [venv_script("rlfleet"), "train", str(REPO / "examples" / "guess_number_tiny.yaml"), *overrides]
    run = subprocess.run(command, cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(row["episode/turns_mean"] > 1.5 and row["episode/masked_token_frac"] > 0.3 for row in rows)
    assert all(row["rollout_logprob_diff"] < 1e-5 for row in rows), [r["rollout_logprob_diff"] for r in rows]
    assert all(row["critic/vf_loss"] > 0 and row["critic/grad_norm"] > 0 for row in rows)
    assert rows[-1]["kl"] > 0, "the policy did not move from the reference"
    assert procs.survivors(procs.launched(tmp_path)) == []
