"""``launcher.type=ray``: the tiny GRPO job trains through Ray-placed tiers on a real local Ray (issue 13).

The run starts its own Ray (4 logical CPUs), its nats-server on every interface named by the node
IP, and every tier in a Ray actor; it trains, the reward rises over the steps, ``rlfleet status
--run`` (a real CLI process, the run's observer login) lists its three workers, every worker's
record names its Ray node, and closing the run leaves none of its processes behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig
from rlfleet.controller.ray_launcher import import_ray

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_tiny_grpo_trains_through_ray_placed_tiers(tmp_path: Path, tiny_model_dir: Path) -> None:
    ray = import_ray(local=True)
    out = tmp_path / "run"
    config = TrainerConfig(
        launcher={"type": "ray", "num_cpus": 4}, output_dir=str(out), rollout_batch_size=16,
        train_batch_size=16, micro_batch_size=128, group_size=8, max_prompt_length=32, max_response_length=12,
        learning_rate=3e-3, kl_coef=0.0, seed=0, loggers=["jsonl"], sample_table_size=0,
    )  # fmt: skip
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789",
                          PromptDataset(str(DATA), max_prompt_length=32), config)  # fmt: skip
    try:
        steps = trainer.steps(num_epochs=3, max_steps=8)
        rewards = [next(steps).metrics["reward/mean"] for _ in range(2)]
        shown = subprocess.run([str(Path(sys.executable).parent / "rlfleet"), "status", "--run", str(out)],
                               capture_output=True, text=True, timeout=120)  # fmt: skip
        rewards += [step.metrics["reward/mean"] for step in steps]
        processes = json.loads((out / "fleet" / "processes.json").read_text())
    finally:
        trainer.close()
    assert shown.returncode == 0, shown.stderr
    first = shown.stdout.splitlines()[0]
    assert first.startswith(f"fleet {trainer.cluster}: rollout 1, reward 1, trainer 1; trainer at step ")
    assert int(re.search(r"at step (\d+),", first).group(1)) >= 2, first  # type: ignore[union-attr]
    rows = {line.split()[1]: line.split() for line in shown.stdout.splitlines()[2:]}
    assert set(rows) == {"rollout-0", "reward-0", "trainer-0"} and all(r[7] == "ok" for r in rows.values())
    assert len(rewards) == 8
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards  # it learns
    node = ray.util.get_node_ip_address() if ray.is_initialized() else processes["workers"][0]["node_ip"]
    assert processes["nats"]["url"].startswith(f"nats://{node}:")
    tiers = sorted(w["tier"] for w in processes["workers"])
    assert tiers == ["reward", "rollout", "trainer"]
    assert all(w["node_ip"] == node and w["node_id"] for w in processes["workers"])
    pids = [processes["nats"]["pid"], *(w["pid"] for w in processes["workers"])]
    assert not any(_alive(pid) for pid in pids)
