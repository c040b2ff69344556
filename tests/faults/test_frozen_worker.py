"""A frozen worker is killed and restarted (issue 29, point 3).

First the launcher alone, with a one-line stand-in worker: a stopped process declared dead as the
pid it runs is SIGKILLed and the next check starts it again within the restart budget, its death
reading as what happened; a pid the launcher did not start (a restart since) and a trainer are
left alone. Then a real embedded run: the run's only rollout worker is stopped with SIGSTOP while
it generates: its process lives but says nothing. The registry declares it dead after
``faults.dead_after_s``; the run then has the launcher SIGKILL that process (the pid it started)
and start it again, counted against ``faults.restart_budget``; the step's generation waits for it
and the run finishes every step.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig
from rlfleet.controller.errors import TierDied
from rlfleet.controller.launcher import EmbeddedFleet, WorkerProcess, WorkerSpec, kill_declared_dead

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
STEPS = 2
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def _restarts(out: Path) -> dict[str, int]:
    workers = json.loads((out / "fleet" / "processes.json").read_text())["workers"]
    return {w["worker_id"]: w.get("restarts", 0) for w in workers}


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped), or ``gone``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.timeout(60)
def test_the_launcher_kills_a_stopped_worker_declared_dead_and_starts_it_again(tmp_path: Path, procs) -> None:
    restarted: list[tuple[WorkerProcess, TierDied]] = []
    with EmbeddedFleet(tmp_path, restart_budget=1) as fleet:
        fleet.start_nats()
        fleet.on_restart = lambda worker, died: restarted.append((worker, died))
        rollout = fleet.spawn(WorkerSpec("rollout", "rollout-0", {}, command=SLEEP))
        trainer = fleet.spawn(WorkerSpec("trainer", "trainer-0", {}, command=SLEEP))
        os.kill(rollout.pid, signal.SIGSTOP)
        assert kill_declared_dead(fleet.workers, "rollout", "rollout-0", rollout.pid + 100000, 5.0) is None
        assert kill_declared_dead(fleet.workers, "trainer", "trainer-0", trainer.pid, 5.0) is None
        assert kill_declared_dead(fleet.workers, "rollout", "rollout-0", rollout.pid, 5.0) is rollout
        deadline = time.monotonic() + 20
        while not restarted:
            assert time.monotonic() < deadline, "the launcher did not start the killed worker again"
            fleet.check()
            time.sleep(0.05)
        [(again, died)] = restarted
        assert again.spec.worker_id == "rollout-0" and again.pid != rollout.pid and procs.alive(again.pid)
        assert not procs.alive(rollout.pid) and procs.alive(trainer.pid)
        assert str(died).startswith(
            "rollout worker rollout-0 was killed by signal SIGKILL (exit code -9): "
            "declared dead after 5.0s without a heartbeat while its process still ran"
        )
        assert fleet.processes.restarts == {"rollout-0": 1}
        assert kill_declared_dead(fleet.workers, "rollout", "rollout-0", rollout.pid, 5.0) is None, (
            "stale pid"
        )
        pids = fleet.pids
    assert procs.survivors(pids) == []


@pytest.mark.timeout(300)
def test_a_stopped_rollout_worker_is_declared_dead_killed_and_restarted(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    out = tmp_path / "run"
    config = TrainerConfig(
        rollout_batch_size=4, train_batch_size=4, group_size=4, max_prompt_length=32, max_response_length=12,
        output_dir=str(out), loggers=["jsonl"], sample_table_size=0, device="cpu",
        faults={"restart_budget": 1, "dead_after_s": 4.0},
    )  # fmt: skip
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789",
                          PromptDataset(str(DATA), max_prompt_length=32, seed=1), config)  # fmt: skip
    frozen: list[int] = []
    try:
        trainer.start()
        first = procs.launched(out)
        fleet = trainer.fleet
        generate = fleet.generate

        async def generate_frozen(*args: Any, **kwargs: Any) -> Any:
            work = asyncio.ensure_future(generate(*args, **kwargs))
            if not frozen:
                await asyncio.sleep(0.02)  # the generate request is on its way to the worker
                os.kill(first["rollout-0"], signal.SIGSTOP)
                frozen.append(first["rollout-0"])
                for _ in range(100):  # the signal lands a moment later
                    if _state(frozen[0]) in ("T", "t"):
                        break
                    await asyncio.sleep(0.01)
                assert _state(frozen[0]) in ("T", "t")
            return await work

        fleet.generate = generate_frozen  # type: ignore[method-assign]
        results = list(trainer.steps(max_steps=STEPS))  # before the fix: NoWorkerServed, the run ended
        last = procs.launched(out)
        assert _restarts(out)["rollout-0"] == 1
        assert last["rollout-0"] != first["rollout-0"]
        assert _state(first["rollout-0"]) in ("gone", "Z"), "the frozen process was killed"
    finally:
        trainer.close()
        for pid in frozen:  # never leave a process this test stopped behind
            if procs.alive(pid):
                os.kill(pid, signal.SIGKILL)
    log = (out / "fleet" / "workers" / "rollout-0.log").read_text()
    assert "--- rlfleet: restart 1 of rollout-0 ---" in log
    assert procs.survivors({**first, **last}) == []
    assert [r.step for r in results] == list(range(1, STEPS + 1))
    assert [r.metrics["rollout/samples"] for r in results] == [16.0] * STEPS
