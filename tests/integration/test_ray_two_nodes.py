"""A two-node Ray cluster on this machine places the tiers where the job's resources say (issue 13).

``ray start --head`` and a second ``ray start --address`` (each in the foreground, ``--block``,
so the test stops exactly the two processes it started, and they take their Ray processes with
them) give two Ray nodes: the head with a custom resource ``trainer_node``, the other with
``rollout_node``. ``rlfleet train examples/tiny_grpo.yaml launcher.type=ray launcher.address=...``
with ``launcher.resources`` asking for those puts the rollout worker on the second node and the trainer on
the head, and the run trains over the addresses Ray reports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _log(tmp_path: Path, name: str) -> str:
    return (tmp_path / f"{name}.log").read_text()


def _nodes(address: str, env: dict[str, str]) -> int:
    probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
             "print(sum(1 for n in ray.nodes() if n['Alive']))")  # fmt: skip
    try:
        done = subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True,
                              timeout=60, env=env)  # fmt: skip
    except subprocess.TimeoutExpired:
        return 0
    return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_rollout_tier_runs_on_the_node_its_resources_name(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    port = _free_port()
    address = f"127.0.0.1:{port}"
    # Ray 2.60 turns on token authentication for a cluster started by `ray start`; this throwaway
    # cluster of one machine leaves it off so the run (another process) needs no token handed over.
    env = {**cli_env, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_AUTH_MODE": "disabled"}
    temp_dir = tempfile.mkdtemp(prefix="rlray-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    common = ["--num-cpus=3", "--block", "--disable-usage-stats"]
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", f"--port={port}", "--include-dashboard=false",
         f"--temp-dir={temp_dir}", '--resources={"trainer_node": 1}', *common],
        stdout=(tmp_path / "head.log").open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    nodes: list[subprocess.Popen[bytes]] = [head]
    try:
        deadline = time.monotonic() + 120
        node_ip = re.compile(r"Local node IP: (\S+)")
        while head.poll() is None and not (found := node_ip.search(_log(tmp_path, "head"))):
            assert time.monotonic() < deadline, _log(tmp_path, "head")
            time.sleep(1)
        address = f"{found.group(1)}:{port}" if found else address  # Ray's GCS listens on the node IP
        while head.poll() is None and _nodes(address, env) < 1:
            assert time.monotonic() < deadline, (tmp_path / "head.log").read_text()
            time.sleep(2)
        assert head.poll() is None, (tmp_path / "head.log").read_text()
        nodes.append(subprocess.Popen(
            [str(BIN / "ray"), "start", f"--address={address}", '--resources={"rollout_node": 1}', *common],
            stdout=(tmp_path / "worker.log").open("w"), stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        ))  # fmt: skip
        while _nodes(address, env) < 2:
            assert nodes[1].poll() is None and time.monotonic() < deadline, (
                tmp_path / "worker.log"
            ).read_text()
            time.sleep(2)
        out = tmp_path / "run"
        resources = "{rollout: {resources: {rollout_node: 1}}, trainer: {resources: {trainer_node: 1}}}"
        run = subprocess.run(
            [str(BIN / "rlfleet"), "train", str(REPO / "examples" / "tiny_grpo.yaml"), "launcher.type=ray",
             f"launcher.address={address}", f"launcher.resources={resources}", "max_steps=3",
             f"output_dir={out}", "loggers=[jsonl]", "sample_table_size=0", "log_every=1"],
            capture_output=True, text=True, timeout=420, env=env,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        workers = {
            w["tier"]: w for w in json.loads((out / "fleet" / "processes.json").read_text())["workers"]
        }
        assert workers["rollout"]["node_id"] != workers["trainer"]["node_id"]
        assert len((out / "metrics.jsonl").read_text().splitlines()) >= 3
    finally:
        for node in reversed(nodes):
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
        for node in reversed(nodes):
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)
