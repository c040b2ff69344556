"""A standalone rollout worker joins a running training job, end to end with the real trainer.

A ``GRPOTrainer`` (library use, fixed ``cluster``) trains a step with its own rollout worker. Then
``rlfleet-rollout serve --model ... --config <the run's join-rollout.yaml> --pool late`` starts
from the model on disk: before it announces itself it asks the trainer (``trainer.latest``, the
trainer's own handler) for the current weights and loads them from the trainer's TensorStore.
The next step is routed to the ``late`` pool alone: the joined worker serves it, and its engine
logprobs match the trainer's recomputed ones (it holds the trained weights, not the disk's).
After it leaves (SIGTERM) the run goes on with its own worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from rlfleet.controller import GRPOTrainer, TrainerConfig
from rlfleet.controller.dataset import PromptDataset

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"


@pytest.mark.timeout(300)
def test_a_worker_joins_a_running_job_at_the_trainers_weights(
    tmp_path: Path, tiny_model_dir: Path, venv_script, cli_env, procs
) -> None:
    cluster = f"join-{uuid.uuid4().hex[:6]}"
    config = TrainerConfig(
        fleet={"cluster": cluster}, rollout={"pools": {"local": {"workers": 1}}}, rollout_batch_size=8,
        train_batch_size=8,
        group_size=4, micro_batch_size=64, max_prompt_length=32, max_response_length=8,
        learning_rate=3e-2, kl_coef=0.0, seed=5, output_dir=str(tmp_path / "run"), loggers=["jsonl"],
        sample_table_size=0,
    )  # fmt: skip
    dataset = PromptDataset(str(DATA), max_prompt_length=32, seed=5)
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789", dataset, config)
    worker: subprocess.Popen[bytes] | None = None
    try:
        steps = trainer.steps(num_epochs=1, max_steps=3)
        first = next(steps)
        assert first.weight_version == 1 and first.routes["any"].workers == ["rollout-local-0"]
        assert first.metrics["rollout_logprob_diff"] < 1e-3

        log = open(tmp_path / "late-0.log", "wb")  # noqa: SIM115 (closed with the process)
        worker = subprocess.Popen(
            [venv_script("rlfleet-rollout"), "serve", "--model", str(tiny_model_dir), "--config",
             str(trainer.fleet_run.join_config), "--pool", "late", "--worker-id", "late-0",
             "placement.device=cpu"],
            stdout=log, stderr=subprocess.STDOUT, env=cli_env,
        )  # fmt: skip
        log.close()
        [joined] = trainer.run(trainer.fleet.registry.wait_for("rollout", 1, 120.0, pool="late"))
        assert joined.worker_id == "late-0"
        assert joined.weight_version == 1, "admitted only at the trainer's current weights"

        trainer.set_rollout_fn(lambda item: "late")
        second = next(steps)
        assert second.routes["late"].workers == ["late-0"]
        assert second.metrics["rollout_logprob_diff"] < 1e-3, "it generated with the trained weights"

        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
        trainer.set_rollout_fn(None)
        third = next(steps)
        assert third.routes["any"].workers == ["rollout-local-0"]
        assert third.weight_version == 3
        pids = trainer.process_ids
    finally:
        if worker is not None and worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
        trainer.close()
    assert procs.survivors(pids) == []
