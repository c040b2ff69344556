"""Failures end a run quickly, say which tier failed and why, and leave no process behind.

Covered: a missing dataset file, a model path that does not exist, an unknown reward function
(the reward worker fails at startup), a worker that crashes at startup (again on each restart,
until its restart budget is spent), a worker that never announces, a trainer killed mid-run with
no checkpoint to restore it from (a rollout or reward worker killed mid-run, and a trainer with
checkpoints, are survived: tests/faults/test_supervision.py, test_trainer_restart.py), and Ctrl-C
on the controller. Each asserts the run ends
within 60 s, the message names the tier and the cause, and every pid the launcher recorded in
``processes.json`` is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig
from rlfleet.controller.errors import TierNotReady, TierNotRestarted

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
REWARD = "charset:allowed=0123456789"


def _train_cli(
    script: str, env: dict[str, str], out: Path, *overrides: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    run = subprocess.run(
        [script, "train", str(EXAMPLE), f"output_dir={out}", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    return run, time.monotonic() - t0


def _trainer(model_dir: Path, out: Path, **overrides: object) -> GRPOTrainer:
    settings: dict[str, object] = {
        "rollout_batch_size": 4, "train_batch_size": 4, "group_size": 4, "max_response_length": 8,
        "max_prompt_length": 32, "kl_coef": 0.0, "learning_rate": 1e-3, "output_dir": str(out),
        "loggers": ["jsonl"], "sample_table_size": 0, "seed": 0,
    }  # fmt: skip
    settings.update(overrides)
    dataset = PromptDataset(str(DATA), max_prompt_length=32)
    return GRPOTrainer(str(model_dir), REWARD, dataset, TrainerConfig(**settings))


def _replace_rollout_command(trainer: GRPOTrainer, command: list[str]) -> None:
    specs = trainer.fleet_run.worker_specs()
    for spec in specs:
        if spec.tier == "rollout":
            spec.command = command
    trainer.fleet_run.worker_specs = lambda: specs  # type: ignore[method-assign]


@pytest.mark.timeout(60)
def test_missing_dataset_fails_before_starting_anything(tmp_path: Path, venv_script, cli_env) -> None:
    missing = tmp_path / "nope.jsonl"
    run, seconds = _train_cli(venv_script("rlfleet"), cli_env, tmp_path / "run", f"data.path={missing}")
    assert run.returncode == 2
    assert f"dataset {missing}: no such file" in run.stderr
    assert not (tmp_path / "run" / "fleet").exists(), "nothing may be spawned for a bad dataset"
    assert seconds < 60


@pytest.mark.timeout(60)
def test_missing_model_fails_before_starting_anything(tmp_path: Path, venv_script, cli_env) -> None:
    missing = tmp_path / "no-model"
    run, _ = _train_cli(venv_script("rlfleet"), cli_env, tmp_path / "run", f"model={missing}")
    assert run.returncode == 2
    assert f"model '{missing}': no such directory" in run.stderr
    assert not (tmp_path / "run" / "fleet").exists()


@pytest.mark.timeout(120)
def test_unknown_reward_names_the_reward_worker_and_the_cause(
    tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    out = tmp_path / "run"
    run, seconds = _train_cli(
        venv_script("rlfleet"), cli_env, out, f"model={tiny_model_dir}", "reward=nosuch"
    )
    assert run.returncode == 2, run.stderr  # a bad reward spec is the user's to fix
    log = out / "fleet" / "workers" / "reward-0.log"
    assert "reward worker reward-0 exited with code 2: UnknownReward: unknown reward 'nosuch'" in run.stderr
    assert f"(log: {log})" in run.stderr
    assert "Traceback" not in run.stderr, "the controller reports the cause, not its own traceback"
    assert seconds < 60
    assert procs.survivors(procs.launched(out)) == []


@pytest.mark.timeout(90)
def test_worker_crashing_at_startup_is_noticed_at_once(tmp_path: Path, tiny_model_dir: Path, procs) -> None:
    out = tmp_path / "run"
    trainer = _trainer(tiny_model_dir, out, startup_timeout_s=120.0, faults={"restart_budget": 2})
    _replace_rollout_command(trainer, [sys.executable, "-c", "raise RuntimeError('engine exploded')"])
    t0 = time.monotonic()
    with pytest.raises(TierNotRestarted) as caught:
        trainer.start()
    assert time.monotonic() - t0 < 30, "a dead process must not wait for startup_timeout_s"
    assert caught.value.tier == "rollout" and caught.value.returncode == 1
    assert "rollout worker rollout-0 exited with code 1: RuntimeError: engine exploded" in str(caught.value)
    assert "restart budget is spent (2 of faults.restart_budget=2 restarts used)" in str(caught.value)
    assert procs.survivors(procs.launched(out)) == []


@pytest.mark.timeout(90)
def test_worker_that_never_announces_times_out(tmp_path: Path, tiny_model_dir: Path, procs) -> None:
    out = tmp_path / "run"
    trainer = _trainer(tiny_model_dir, out, startup_timeout_s=8.0)
    _replace_rollout_command(trainer, [sys.executable, "-c", "import time; time.sleep(600)"])
    t0 = time.monotonic()
    with pytest.raises(TierNotReady) as caught:
        trainer.start()
    assert 8.0 <= time.monotonic() - t0 < 60
    pid = procs.launched(out)["rollout-0"]
    assert f"rollout worker rollout-0 (pid {pid}, still running; log:" in str(caught.value)
    assert procs.survivors(procs.launched(out)) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_trainer_killed_mid_run_without_checkpoints_ends_the_run(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    out = tmp_path / "run"
    trainer = _trainer(tiny_model_dir, out)
    steps = trainer.steps(num_epochs=1, max_steps=50)
    first = next(steps)
    assert "kl" not in first.metrics and "kl_loss" not in first.metrics  # kl_coef=0: no reference
    trainer.kl_coef = 0.1  # between steps: the next TrainStepRequest carries it to the trainer
    second = next(steps)
    assert second.metrics["kl_coef"] == 0.1 and "kl_loss" in second.metrics and "kl" in second.metrics
    assert second.weight_version == 2

    pids = procs.launched(out)
    assert all(procs.alive(pid) for pid in pids.values())
    os.kill(pids["trainer-0"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TierNotRestarted) as caught:
        next(steps)
    assert time.monotonic() - t0 < 60
    assert "trainer worker trainer-0 was killed by signal SIGKILL" in str(caught.value)
    assert "save_every is not set, so there is no checkpoint to restore it from" in str(caught.value)
    assert procs.survivors(pids) == []


@pytest.mark.timeout(120)
def test_sigterm_while_starting_stops_every_process_the_run_started(
    tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    out = tmp_path / "run"
    command = [venv_script("rlfleet"), "train", str(EXAMPLE), f"output_dir={out}", f"model={tiny_model_dir}"]
    proc = subprocess.Popen(
        command, cwd=REPO, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / "fleet" / "processes.json").exists() or len(procs.launched(out)) < 4:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the run did not start its processes within 60 s"
            time.sleep(0.1)
        pids = procs.launched(out)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "terminated by SIGTERM; every process this run started has been stopped" in stderr
    assert procs.survivors(pids) == []


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_process_the_run_started(
    tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    out = tmp_path / "run"  # long enough (150 steps take 14 s on a quiet machine) to be interrupted
    command = [venv_script("rlfleet"), "train", str(EXAMPLE), f"output_dir={out}", f"model={tiny_model_dir}",
               "num_epochs=1000", "max_steps=100000", "log_every=1", "sample_table_size=0",
               "rollout_batch_size=4", "train_batch_size=4", "group_size=4"]  # fmt: skip
    # as from a terminal: a pytest started in the background (`cmd &` in a script) ignores SIGINT,
    # and a child inherits that, so Ctrl-C would never reach the run
    proc = subprocess.Popen(
        command, cwd=REPO, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_sigint_default,
    )  # fmt: skip
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no step finished within 120 s"
            time.sleep(0.2)
        pids = procs.launched(out)
        assert len(pids) == 4 and all(procs.alive(pid) for pid in pids.values())
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=150)  # workers stop after their step; slow on a loaded machine
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted; every process this run started has been stopped" in stderr
    assert procs.survivors(pids) == []
