"""The embedded launcher gives each process it starts its own CUDA_VISIBLE_DEVICES (issue 13).

The job's real worker specs (trainer ranks, reward, two rollout pools) go through the job's launcher
(``build_launcher``) with a ``launcher.gpus`` list; each process is a stand-in that sleeps
(``WorkerSpec.command``: the GPU environment is the launcher's, whatever the program), so this runs in
seconds on a CPU machine.
The environment is read from each started process's ``/proc/<pid>/environ``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.run import build_launcher
from rlfleet.controller.worker_configs import worker_specs

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.timeout(60)
def test_each_started_process_sees_its_own_gpus(tmp_path: Path) -> None:
    cfg = TrainerConfig(
        device="cpu", num_train_workers=2, launcher={"gpus": [0, 1, 2, 3, 4, 5]},
        output_dir=str(tmp_path / "run"),
        rollout={"pools": {"small": {"workers": 1},
                           "big": {"workers": 1, "engine": {"type": "vllm", "tensor_parallel_size": 2}}}},
    )  # fmt: skip
    specs = worker_specs(cfg, tmp_path / "model", "c1", online=True,
                         reward_spec="reward_model:path=/m,device=cuda")  # fmt: skip
    with build_launcher(cfg, tmp_path / "fleet") as fleet:
        fleet.start_nats()
        started = [fleet.spawn(replace(spec, command=SLEEPER)) for spec in specs]
        seen = {w.spec.worker_id: _environ(w.pid).get("CUDA_VISIBLE_DEVICES") for w in started}
        record = json.loads((tmp_path / "fleet" / "processes.json").read_text())
    assert seen == {"trainer-0": "0", "trainer-0-rank1": "1", "rollout-small-0": "2", "rollout-big-0": "3,4",
                    "reward-0": "5"}  # fmt: skip
    assert {w["worker_id"]: w["cuda_visible_devices"] for w in record["workers"]} == seen


@pytest.mark.timeout(60)
def test_without_gpus_the_environment_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # device=cpu: nothing is placed, the env passes on
    cfg = TrainerConfig(device="cpu", output_dir=str(tmp_path / "run"))
    specs = worker_specs(cfg, tmp_path / "model", "c1", online=True, reward_spec="concise")
    with build_launcher(cfg, tmp_path / "fleet") as fleet:
        fleet.start_nats()
        started = [fleet.spawn(replace(spec, command=SLEEPER)) for spec in specs]
        seen = {_environ(w.pid).get("CUDA_VISIBLE_DEVICES") for w in started}
    assert seen == {"7"}
