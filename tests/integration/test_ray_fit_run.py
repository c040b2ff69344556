"""``launcher.type=ray`` on a small machine (issue 36): a job its Ray cannot hold is refused at once, a
local Ray started for the run fits the job, and an actor Ray cannot place stops with a named error.

- ``rlfleet train examples/tiny_grpo.yaml launcher.type=ray launcher.num_cpus=1`` (a real CLI process, a real
  local Ray of 1 CPU) exits 2 within seconds, its one line naming what the job reserves (3 CPUs)
  and what the Ray has (1 CPU), before any worker is placed.
- The same job without ``launcher.num_cpus`` gets a local Ray of as many logical CPUs as it reserves when
  the machine has fewer cores (this one has 2), says so in its log, and trains.
- A worker whose actor Ray cannot place (it reserves a resource no node has; the job check is
  skipped by building the fleet without a job) ends in :class:`WorkerStartTimeout` at its deadline,
  naming the worker, what it reserves and what is free, and the pending actor is dropped.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from rlfleet.controller.errors import WorkerStartTimeout
from rlfleet.controller.launcher import WorkerSpec
from rlfleet.controller.ray_fit import machine_cpus
from rlfleet.controller.ray_launcher import RayFleet, RayPlacement, TierResources, import_ray

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"
SMALL = ["max_steps=2", "loggers=[jsonl]", "sample_table_size=0", "log_every=1"]


def _train(venv_script, env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([venv_script("rlfleet"), "train", str(EXAMPLE), "launcher.type=ray", *SMALL, *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.timeout(120)
def test_a_job_its_local_ray_cannot_hold_is_refused_at_once(
    venv_script, cli_env, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    began = time.monotonic()
    run = _train(venv_script, cli_env, "launcher.num_cpus=1", f"output_dir={out}", timeout=110)
    took = time.monotonic() - began
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "rlfleet: launcher=ray: the job reserves 3 CPUs (trainer 1, rollout 1, reward 1) and 0 GPUs; "
        "the local Ray cluster at "
    ), run.stderr[-3000:]
    assert "has 1 CPU, 0 GPUs; set launcher.num_cpus=3 for a local Ray (or leave it unset)" in last
    assert "Traceback" not in run.stderr
    assert took < 60, f"refused after {took:.0f} s"
    assert not (out / "fleet" / "processes.json").exists(), "nothing may be placed"


@pytest.mark.timeout(240)
def test_the_tiny_job_trains_on_a_local_ray_sized_to_it(
    venv_script, cli_env, tiny_model_dir: Path, tmp_path: Path, procs
) -> None:
    out = tmp_path / "run"
    run = _train(venv_script, cli_env, f"output_dir={out}", "--log-level", "INFO", timeout=220)
    assert run.returncode == 0, run.stderr[-3000:]
    cores = machine_cpus()
    sized = f"local Ray started with 3 logical CPUs for {cores} cores: the job reserves 3"
    assert (sized in run.stderr) == (cores < 3), run.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "reward/mean" in s] == [1, 2]
    workers = json.loads((out / "fleet" / "processes.json").read_text())["workers"]
    assert procs.survivors([w["pid"] for w in workers]) == []


@pytest.mark.timeout(90)
def test_an_actor_ray_cannot_place_stops_with_a_named_error(tmp_path: Path) -> None:
    ray = import_ray(local=True)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        placement = RayPlacement({"reward": TierResources(num_cpus=1, resources={"no_such_node": 1})})
        fleet = RayFleet(tmp_path / "fleet", placement=placement, start_timeout_s=3)
        fleet.join_nats("nats://127.0.0.1:4222", {})  # never reached: the actor is never placed
        began = time.monotonic()
        with pytest.raises(WorkerStartTimeout) as caught:
            fleet.spawn(WorkerSpec("reward", "reward-0", {"fleet": {"cluster": "fit"}}))
        assert time.monotonic() - began < 30
        assert str(caught.value) == (
            "reward-0's Ray actor did not start within 3 s; it reserves {CPU: 1, no_such_node: 1}; "
            "the cluster has {CPU: 1, GPU: 0, no_such_node: 0} available (raise startup_timeout_s if "
            "other work frees it later)"
        )
        assert fleet.workers == []
        fleet.stop(timeout=5)
    finally:
        ray.shutdown()
