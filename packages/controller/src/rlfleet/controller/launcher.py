"""The embedded launcher: a private nats-server and every tier as a local process.

Each worker is started through its console script (``rlfleet-rollout serve --config ...``), with
its config written as YAML and its output captured in a log file under the run directory. The
launcher stops exactly the processes it started: on normal exit, on Ctrl-C and on error, and the
children get SIGTERM from the kernel if the controller itself dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlfleet.common.embedded_nats import EmbeddedNats
from rlfleet.controller.errors import TierDied

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass
class WorkerSpec:
    """One worker process to start: its tier's console script and its config."""

    tier: str
    worker_id: str
    config: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def script(self) -> str:
        return f"rlfleet-{self.tier}"


@dataclass
class WorkerProcess:
    spec: WorkerSpec
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    os.setsid()


def find_script(name: str) -> str:
    """A console script of this environment: next to the running interpreter first, then PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"console script {name!r} not found next to {sys.executable} nor on PATH; "
            "is its rlfleet package installed in this environment?"
        )
    return found


class EmbeddedFleet:
    """Starts and stops a private nats-server plus worker processes for one run."""

    def __init__(self, run_dir: Path, *, jetstream: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.jetstream = jetstream
        self.nats: EmbeddedNats | None = None
        self.workers: list[WorkerProcess] = []

    @property
    def url(self) -> str:
        assert self.nats is not None, "start_nats() first"
        return self.nats.url

    def start_nats(self) -> str:
        self.nats = EmbeddedNats(jetstream=self.jetstream)
        self.nats.start()
        logger.info("embedded nats-server pid %s at %s", self.nats.pid, self.nats.url)
        return self.nats.url

    def spawn(self, spec: WorkerSpec) -> WorkerProcess:
        """Start one worker; its config gets this fleet's NATS URL."""
        config_dir = self.run_dir / "workers"
        config_dir.mkdir(parents=True, exist_ok=True)
        config_path = config_dir / f"{spec.worker_id}.yaml"
        config = {**spec.config, "nats_url": self.url, "worker_id": spec.worker_id}
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        log_path = config_dir / f"{spec.worker_id}.log"
        command = [find_script(spec.script), "serve", "--config", str(config_path)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, preexec_fn=_die_with_parent,
            )  # fmt: skip
        logger.info("started %s worker %s (pid %d), log %s", spec.tier, spec.worker_id, process.pid, log_path)
        worker = WorkerProcess(spec, process, log_path)
        self.workers.append(worker)
        return worker

    def check(self) -> None:
        """Raise :class:`TierDied` if any worker process has exited."""
        for worker in self.workers:
            code = worker.process.poll()
            if code is not None:
                raise TierDied(worker.spec.tier, worker.spec.worker_id, code, worker.log_tail())

    def stop(self, timeout: float = 10.0) -> None:
        """Stop exactly the processes this fleet started: SIGTERM, wait, then SIGKILL."""
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                worker.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                logger.warning("worker %s did not stop in %.0fs; killing it", worker.spec.worker_id, timeout)
                worker.process.kill()
                worker.process.wait(timeout=5)
        self.workers.clear()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None

    def __enter__(self) -> EmbeddedFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
