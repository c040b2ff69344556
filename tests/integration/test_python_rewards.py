"""Rewards as plain Python, through real runs: a lambda as ``reward=`` of a tiny GRPO run (the
controller scores it; no reward worker starts), switched mid-run to TRL's batched form, then to a
spec (the run starts its reward worker then), then to a function that raises (a named error, every
process stopped); and ``rlfleet train`` as a subprocess with ``reward: my_rewards:fn + ...`` where
``my_rewards.py`` is in the working directory and another module next to the job file.

The rewards are made so that a score can only come from the user's function (over 100, or 1000),
and each step's ``reward/mean`` is checked against the scores the function itself gave.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
SAMPLES = 8 * 4  # rollout_batch_size x group_size: one step's scores
TINY = {"rollout_batch_size": 8, "train_batch_size": 8, "micro_batch_size": 64, "group_size": 4,
        "max_prompt_length": 32, "max_response_length": 8, "learning_rate": 0.003, "kl_coef": 0.0,
        "seed": 0, "sample_table_size": 0}  # fmt: skip


def tiers(trainer: Any) -> list[str]:
    return sorted(w.spec.tier for w in trainer.fleet_run.launcher.workers)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_lambda_trains_then_trl_form_then_a_spec_then_a_failing_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rlfleet_cache: Path, tiny_model_dir: Path, procs: Any
) -> None:
    from rlfleet.controller import GRPOTrainer, TrainerConfig
    from rlfleet.controller.errors import RewardFnFailed

    monkeypatch.setenv("RLFLEET_CACHE", str(rlfleet_cache))
    given: list[float] = []  # every score the user's functions gave, in order

    def digit_share(text: str) -> float:
        score = sum(c.isdigit() for c in text) / max(len(text), 1)
        given.append(score)
        return score

    def trl_style(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        assert len(prompts) == len(completions)
        scores = [100.0 + len(c) for c in completions]
        given.extend(scores)
        return scores

    out = tmp_path / "run"
    config = TrainerConfig(**TINY, output_dir=str(out), loggers=["jsonl"])
    trainer = GRPOTrainer("tiny:digits", lambda text: digit_share(text), str(DATA), config)
    steps: list[dict[str, float]] = []
    try:
        with pytest.raises(RewardFnFailed, match=r"reward function .*<lambda> raised ZeroDivisionError"):
            for result in trainer.steps(max_steps=5):
                scores, given[:] = list(given), []
                steps.append(result.metrics)
                if result.step <= 3:  # step 4 is the spec's, scored by the reward worker
                    assert len(scores) == SAMPLES and result.metrics["reward/mean"] == pytest.approx(
                        statistics.fmean(scores)
                    ), f"step {result.step}: the run's reward is not the function's"
                if result.step <= 2:
                    assert "reward" not in tiers(trainer), "a Python reward needs no reward worker"
                    assert all(0.0 <= s <= 1.0 for s in scores)
                if result.step == 2:
                    assert trainer.set_reward_fn(trl_style).endswith("-r1")
                    assert "trl_style" in str(trainer.reward_spec)
                if result.step == 3:
                    assert min(scores) >= 100.0
                    trainer.set_reward_fn("charset:allowed=0123456789")  # starts the run's reward worker
                    assert tiers(trainer).count("reward") == 1
                if result.step == 4:
                    assert scores == [], "the spec's scores come from the reward worker"
                    assert trainer.reward_stats().endpoints["default"].spec.startswith("charset")
                    trainer.set_reward_fn(lambda text: 1 / 0)
    finally:
        pids = trainer.fleet_run.process_ids
        trainer.close()
    assert procs.survivors(pids) == [], "the failed step stopped every process the run started"
    assert len(steps) == 4
    assert [m["reward/spec_version_changed"] for m in steps] == [0.0, 0.0, 1.0, 1.0]
    assert 0.0 <= steps[3]["reward/mean"] <= 1.0 and steps[2]["reward/mean"] >= 100.0


MY_REWARDS = '''
import json

LOG = {log!r}


def fn(prompt, response):
    """1000 plus the response's length: no built-in reward scores like this."""
    score = 1000.0 + len(response)
    with open(LOG, "a") as out:
        out.write(json.dumps({{"response": response, "score": score}}) + "\\n")
    return score
'''


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_cli_reward_and_rollout_fn_from_the_working_directory_and_the_job_folder(
    tmp_path: Path, venv_script: Callable[[str], str], cli_env: dict[str, str], tiny_model_dir: Path,
    procs: Any,
) -> None:  # fmt: skip
    work, jobs, log = tmp_path / "work", tmp_path / "jobs", tmp_path / "calls.jsonl"
    work.mkdir()
    jobs.mkdir()
    (work / "my_rewards.py").write_text(MY_REWARDS.format(log=str(log)))
    (jobs / "job_rewards.py").write_text("def bonus(prompt, response):\n    return 0.5\n")
    (jobs / "job_routes.py").write_text("def route(item):\n    return None  # any pool\n")
    out = tmp_path / "run"
    job = {**TINY, "model": "tiny:digits", "reward": "my_rewards:fn + job_rewards:bonus",
           "data": {"path": str(DATA)}, "rollout_fn": "job_routes:route", "max_steps": 3,
           "output_dir": str(out), "loggers": ["jsonl"]}  # fmt: skip
    (jobs / "job.yaml").write_text(yaml.safe_dump(job))
    run = subprocess.run([venv_script("rlfleet"), "train", str(jobs / "job.yaml")], cwd=work, env=cli_env,
                         capture_output=True, text=True, timeout=450)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(c["score"] == 1000.0 + len(c["response"]) for c in calls)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and len(calls) == 3 * SAMPLES, "the reward worker scored each sample once"
    for k, row in enumerate(rows):
        mine = statistics.fmean(c["score"] for c in calls[k * SAMPLES : (k + 1) * SAMPLES])
        assert row["reward/my_rewards:fn"] == pytest.approx(mine)
        assert row["reward/job_rewards:bonus"] == pytest.approx(0.5)
        assert row["reward/mean"] == pytest.approx(mine + 0.5)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert str(jobs) in saved["python_path"], "the job file's folder is on the run's python path"
    assert procs.survivors(procs.launched(out)) == []
