"""A pool momentarily empty waits for its worker (issue 29, point 2), in a real embedded run.

The run has one rollout worker. It is SIGKILLed while it generates the first step's chunk, and
again while the second step's weights are being synced to it: each time its pool is empty until
the launcher has started it again. The work in flight waits for it (within ``faults``) and then
runs: the run finishes every step with every sample, each step once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
STEPS = 3


def _restarts(out: Path) -> dict[str, int]:
    workers = json.loads((out / "fleet" / "processes.json").read_text())["workers"]
    return {w["worker_id"]: w.get("restarts", 0) for w in workers}


class Killer:
    """SIGKILLs the run's only rollout worker at chosen moments, and remembers whom it killed."""

    def __init__(self, out: Path, procs: Any) -> None:
        self.out, self.procs = out, procs
        self.killed: dict[str, int] = {}

    def kill(self, when: str) -> None:
        pid = self.procs.launched(self.out)["rollout-0"]
        os.kill(pid, signal.SIGKILL)
        self.killed[when] = pid


def _kill_during(trainer: GRPOTrainer, killer: Killer) -> None:
    """Kill the rollout worker while step 1 generates and while step 2's weights are loaded."""
    fleet = trainer.fleet
    generate, load_weights = fleet.generate, fleet.load_weights

    async def generate_killed(*args: Any, **kwargs: Any) -> Any:
        work = asyncio.ensure_future(generate(*args, **kwargs))
        if "generation" not in killer.killed:
            await asyncio.sleep(0.02)  # the generate request is on its way to the worker
            killer.kill("generation")
        return await work

    async def load_killed(published: Any, *keep: int) -> Any:
        work = asyncio.ensure_future(load_weights(published, *keep))
        if "weight sync" not in killer.killed and published.weight_version == 2:
            await asyncio.sleep(0)  # the load request goes out
            killer.kill("weight sync")
        return await work

    fleet.generate = generate_killed  # type: ignore[method-assign]
    fleet.load_weights = load_killed  # type: ignore[method-assign]


@pytest.mark.timeout(300)
def test_the_only_rollout_worker_killed_during_generation_and_weight_sync(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    out = tmp_path / "run"
    config = TrainerConfig(
        rollout_batch_size=4, train_batch_size=4, group_size=4, max_prompt_length=32, max_response_length=12,
        output_dir=str(out), loggers=["jsonl"], sample_table_size=0, device="cpu",
        faults={"restart_budget": 2},
    )  # fmt: skip
    assert config.rollout.workers == 1
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789",
                          PromptDataset(str(DATA), max_prompt_length=32, seed=1), config)  # fmt: skip
    killer = Killer(out, procs)
    try:
        trainer.start()
        first = procs.launched(out)
        _kill_during(trainer, killer)
        results = list(trainer.steps(max_steps=STEPS))  # before the fix: NoWorkerServed, the run ended
        last = procs.launched(out)
        assert _restarts(out)["rollout-0"] == 2
    finally:
        trainer.close()
    assert sorted(killer.killed) == ["generation", "weight sync"]
    assert len({first["rollout-0"], *killer.killed.values(), last["rollout-0"]}) == 3
    assert procs.survivors({**first, **last}) == []
    assert [r.step for r in results] == list(range(1, STEPS + 1))
    assert [r.metrics["rollout/samples"] for r in results] == [16.0] * STEPS, "every sample of every step"
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, STEPS + 1)), "each step once"
