"""Supervision in the embedded default (issue 12, point 5): crashed rollout and reward workers come back.

First the launcher alone, with one-line stand-in workers (seconds): a crashed rollout worker is
started again under its id within ``restart_budget`` (new pid in ``processes.json``, its log kept
after a marker line, ``on_restart`` told), and a crash past the budget is a
:class:`TierNotRestarted` naming the budget; a trainer is never restarted behind the run's back.
Then a real tiny ``rlfleet train`` run: SIGKILL a rollout worker, then the reward worker, mid-run;
the run completes every step, each step logged once, and stops every process it started. And a
real run whose rollout worker is killed once more than ``restart_budget`` allows stops with
``TierNotRestarted`` naming the worker and the budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfleet.controller.errors import TierDied, TierNotRestarted
from rlfleet.controller.launcher import EmbeddedFleet, WorkerProcess, WorkerSpec

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"
CRASH = [sys.executable, "-c", "import time; time.sleep(0.3); raise RuntimeError('engine exploded')"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def _check_until(fleet: EmbeddedFleet, done, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the launcher did not get there in time"
        fleet.check()
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_crashed_rollout_worker_is_restarted_within_its_budget(tmp_path: Path, procs) -> None:
    restarted: list[tuple[WorkerProcess, TierDied]] = []
    with EmbeddedFleet(tmp_path, restart_budget=2) as fleet:
        fleet.start_nats()
        fleet.on_restart = lambda worker, died: restarted.append((worker, died))
        first = fleet.spawn(WorkerSpec("rollout", "rollout-0", {}, command=CRASH))
        _check_until(fleet, lambda: len(restarted) == 2)
        assert [w.spec.worker_id for w, _ in restarted] == ["rollout-0", "rollout-0"]
        assert len({first.pid, *(w.pid for w, _ in restarted)}) == 3, "each restart is a new process"
        assert "RuntimeError: engine exploded" in str(restarted[0][1])
        recorded = json.loads((tmp_path / "processes.json").read_text())["workers"]
        assert recorded == [{"tier": "rollout", "worker_id": "rollout-0", "pid": restarted[-1][0].pid,
                             "log": str(first.log_path), "restarts": 2}]  # fmt: skip
        with pytest.raises(TierNotRestarted) as caught:
            _check_until(fleet, lambda: False)
        assert caught.value.tier == "rollout" and caught.value.returncode == 1
        message = str(caught.value)
        assert message.startswith("rollout worker rollout-0 exited with code 1: RuntimeError: engine explo")
        assert "restart budget is spent (2 of faults.restart_budget=2 restarts used)" in message
        log = first.log_path.read_text()
        assert log.count("RuntimeError: engine exploded") == 3
        assert "--- rlfleet: restart 2 of rollout-0 ---" in log
        pids = fleet.pids
    assert procs.survivors(pids) == []


@pytest.mark.timeout(60)
def test_the_trainer_and_a_refusal_are_not_restarted_by_the_launcher(tmp_path: Path, procs) -> None:
    with EmbeddedFleet(tmp_path, restart_budget=3) as fleet:
        fleet.start_nats()
        trainer = fleet.spawn(WorkerSpec("trainer", "trainer-0", {}, command=SLEEP))
        os.kill(trainer.pid, signal.SIGKILL)
        with pytest.raises(TierDied) as caught:
            _check_until(fleet, lambda: False)
        assert type(caught.value) is TierDied and caught.value.tier == "trainer"
        again = fleet.restart_tier("trainer", caught.value)  # the run asks: it restores the state
        assert [w.spec.worker_id for w in again] == ["trainer-0"] and procs.alive(again[0].pid)
        assert fleet.processes.restarts == {"trainer-0": 1}
        refusing = [sys.executable, "-c", "import sys; sys.exit(2)"]
        fleet.spawn(WorkerSpec("reward", "reward-0", {}, command=refusing))
        with pytest.raises(Exception) as refused:
            _check_until(fleet, lambda: False)
        assert type(refused.value).__name__ == "TierRefused", "a worker refusing its settings stays down"
        pids = fleet.pids
    assert procs.survivors(pids) == []


# --- a real run -----------------------------------------------------------------------------------


def _steps_done(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.strip()]


def _wait(proc: subprocess.Popen[str], what: str, done, timeout: float = 150.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"the run ended while waiting for {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.1)


def _restarts(out: Path) -> dict[str, int]:
    workers = json.loads((out / "fleet" / "processes.json").read_text())["workers"]
    return {w["worker_id"]: w.get("restarts", 0) for w in workers}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_survives_sigkill_of_a_rollout_worker_and_of_the_reward_worker(
    tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    out, steps = tmp_path / "run", 10
    command = [venv_script("rlfleet"), "train", str(EXAMPLE), f"output_dir={out}", f"model={tiny_model_dir}",
               f"max_steps={steps}", "rollout.workers=2", "rollout_batch_size=4", "train_batch_size=4",
               "group_size=4", "sample_table_size=0", "log_every=1", "loggers=[jsonl]",
               "request_timeout_s=60"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=REPO, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        _wait(proc, "second step", lambda: len(_steps_done(out)) >= 2)
        first = procs.launched(out)
        os.kill(first["rollout-0"], signal.SIGKILL)
        at = len(_steps_done(out))
        _wait(proc, "rollout restart", lambda: _restarts(out).get("rollout-0") == 1)
        _wait(proc, "steps after the rollout kill", lambda: len(_steps_done(out)) >= at + 2)
        os.kill(procs.launched(out)["reward-0"], signal.SIGKILL)
        at = len(_steps_done(out))
        _wait(proc, "reward restart", lambda: _restarts(out).get("reward-0") == 1)
        _wait(proc, "steps after the reward kill", lambda: len(_steps_done(out)) >= at + 1)
        last = procs.launched(out)
        stdout, stderr = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert f"done: {steps} steps" in stdout
    assert _steps_done(out) == list(range(1, steps + 1)), "every step once, none lost, none twice"
    assert "rollout worker rollout-0 was killed by signal SIGKILL" in stderr and "starting it again" in stderr
    assert "reward worker reward-0 was killed by signal SIGKILL" in stderr
    assert last["rollout-0"] != first["rollout-0"] and last["reward-0"] != first["reward-0"]
    assert last["trainer-0"] == first["trainer-0"] and last["rollout-1"] == first["rollout-1"]
    assert procs.survivors({**first, **last}) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rollout_worker_crashing_past_its_budget_stops_the_run_naming_it(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig

    out = tmp_path / "run"
    config = TrainerConfig(
        rollout_batch_size=4, train_batch_size=4, group_size=4, max_response_length=8, max_prompt_length=32,
        kl_coef=0.0, output_dir=str(out), loggers=["jsonl"], sample_table_size=0, seed=0,
        faults={"restart_budget": 1},
    )  # fmt: skip
    dataset = PromptDataset(str(REPO / "examples" / "data" / "tiny_digits.jsonl"), max_prompt_length=32)
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789", dataset, config)
    steps = trainer.steps(num_epochs=3, max_steps=50)
    next(steps)
    first = procs.launched(out)
    os.kill(first["rollout-0"], signal.SIGKILL)
    next(steps)  # restarted, rejoined, the step done
    second = procs.launched(out)
    assert second["rollout-0"] != first["rollout-0"] and _restarts(out)["rollout-0"] == 1
    os.kill(second["rollout-0"], signal.SIGKILL)
    with pytest.raises(TierNotRestarted) as caught:
        next(steps)
    message = str(caught.value)
    assert message.startswith("rollout worker rollout-0 was killed by signal SIGKILL")
    assert "its restart budget is spent (1 of faults.restart_budget=1 restarts used)" in message
    assert procs.survivors({**first, **second}) == []
