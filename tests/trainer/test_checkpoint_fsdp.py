"""A sharded (FSDP2, 2 gloo ranks) training checkpoint resumes exactly.

The ranks run ``checkpoint_ranks.py`` as two processes with the torchrun variables set: the
parameters after save, update are compared with those after load, the same update.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

RANKS_SCRIPT = Path(__file__).with_name("checkpoint_ranks.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow  # two ranks start and build four sharded actors (about 20 s on 2 cores)
@pytest.mark.timeout(150)
def test_two_ranks_resume_a_sharded_checkpoint_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    procs = []
    for rank in range(2):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115  (closed below)
        command = [sys.executable, str(RANKS_SCRIPT), str(tiny_model_dir), str(tmp_path)]
        procs.append((subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=120)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} >= {
        "actor",
        "state.json",
        "rng-0.json",
        "rng-1.json",
    }
    expected = load_file(str(tmp_path / "expected.safetensors"))
    resumed = load_file(str(tmp_path / "resumed.safetensors"))
    assert expected.keys() == resumed.keys() and expected
    for name, value in expected.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)
