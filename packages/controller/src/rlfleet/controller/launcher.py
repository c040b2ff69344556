"""Start and watch the worker processes, and the event loop that fails fast when one dies.

The embedded launcher runs a private nats-server and every tier as a local process. The server
takes only the run's generated credentials, one per role, each allowed only its role's subjects
(:mod:`rlfleet.common.control.nats_roles`); each worker gets its own role's credential in its
environment (``RLFLEET_NATS_*``, not argv, so ``ps`` does not show it). Each worker is
started through its console script (``rlfleet-rollout serve --config ...``), with its config (the
tier's schema object, validated, or a dict) written as YAML and its output captured in a log file
under the run directory; the pids go to ``processes.json`` there. The launcher stops exactly the
processes it started (each worker leads its own process group, so whatever a worker spawned goes
with it): on normal exit, on Ctrl-C and on error. Workers also get SIGTERM from the kernel if the
thread that started them dies (``PR_SET_PDEATHSIG``), so a controller killed outright does not
leave them running. :class:`NatsSecurity` holds the benchmark-only ways to run the server
otherwise (open, or with TLS too), for ``benchmarks/security_overhead.py``.

The controller's event loop (:class:`GuardedLoop`) turns synchronous calls into async fleet code:
users drive training with plain calls (``trainer.steps()``, ``trainer.set_reward_fn(...)``); each
runs a coroutine there to the end. While it runs, the processes the run started are checked four
times a second (:meth:`EmbeddedFleet.check`), so a worker that dies ends the wait at once with its
:class:`~rlfleet.controller.errors.TierDied` instead of a request timing out later.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import yaml
from pydantic import BaseModel

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.nats_roles import ROLES, RunCredentials, server_config
from rlfleet.common.control.procs import die_with_parent
from rlfleet.common.control.worker import USER_ERROR_EXIT
from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.connection import ENV_PREFIX as NATS_ENV_PREFIX
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.controller.errors import TierDied, TierRefused

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The final line of a Python traceback: "pkg.mod.SomeError: what went wrong".
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Z]\w*): (\S.*)$")
_MAX_ERROR_CHARS = 400


@dataclass
class WorkerSpec:
    """One worker process to start: its tier's console script and its config (the tier's worker
    config object, e.g. ``TrainerWorkerConfig``, or a plain dict for a tier without one).

    ``command`` replaces the console script (``[sys.executable, "-m", "mypkg.worker"]``, a wrapper
    such as a profiler); ``serve --config FILE`` is appended to it either way.
    """

    tier: str
    worker_id: str
    config: BaseModel | dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    command: list[str] | None = None

    @property
    def script(self) -> str:
        return f"rlfleet-{self.tier}"

    def config_data(self, nats_url: str) -> dict[str, Any]:
        """What the worker's config file holds: its config, joining ``nats_url`` as ``worker_id``."""
        config = (
            self.config.model_dump(mode="json") if isinstance(self.config, BaseModel) else dict(self.config)
        )
        config.pop("nats_auth", None)  # credentials travel in the environment, never in a file
        return {**config, "nats_url": nats_url, "worker_id": self.worker_id}


@dataclass
class WorkerProcess:
    """A started worker: its spec, process and log file."""

    spec: WorkerSpec
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def died(self) -> TierDied | TierRefused | None:
        """The error describing this worker's exit, or None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        tail = self.log_tail(40)
        error = "" if code < 0 else last_error_line(tail)
        kind = TierRefused if code == USER_ERROR_EXIT else TierDied  # exit 2: the worker refused its settings
        return kind(
            self.spec.tier, self.spec.worker_id, code, error=error, log_path=self.log_path, log_tail=tail
        )

    def describe(self) -> str:
        """``rollout worker rollout-0 (pid 12, still running; log: ...)`` for error messages."""
        code = self.process.poll()
        state = "still running" if code is None else f"exited with code {code}"
        return (
            f"{self.spec.tier} worker {self.spec.worker_id} (pid {self.pid}, {state}; log: {self.log_path})"
        )


def last_error_line(log_text: str) -> str:
    """The line of a crashed process's output that says why: the exception its traceback ends with
    (``UnknownReward: ...``, module path dropped), else its last non-empty line."""
    lines = [line.rstrip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        found = _EXCEPTION_LINE.match(line)
        if found:
            return _shorten(f"{found.group(1)}: {found.group(2)}")
    return _shorten(lines[-1].strip()) if lines else ""


def _shorten(text: str) -> str:
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


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


@contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ignore Ctrl-C while the fleet stops, so a second Ctrl-C cannot leave processes behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


BENCHMARK_NATS_ENV = "RLFLEET_BENCHMARK_NATS"
"""Benchmark-only: ``open`` or ``tls:CERT_FILE,KEY_FILE`` (see :class:`NatsSecurity`)."""


@dataclass(frozen=True)
class NatsSecurity:
    """How an embedded run's nats-server is secured. Every run gets the default: a credential and
    permissions per role. The others exist only so that ``benchmarks/security_overhead.py`` can
    measure what security costs; no job-file setting reaches them, only the ``security`` argument
    or the ``RLFLEET_BENCHMARK_NATS`` variable of the controller's environment. ``open``: no
    credentials, no permissions (any local process may command the run). ``tls_cert`` and
    ``tls_key``: the default plus TLS; clients trust that certificate as their CA (self-signed)."""

    open: bool = False
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NatsSecurity:
        """``RLFLEET_BENCHMARK_NATS`` of ``env``: unset (the default), ``open`` or ``tls:CERT,KEY``."""
        value = env.get(BENCHMARK_NATS_ENV, "").strip()
        if not value:
            return cls()
        if value == "open":
            return cls(open=True)
        cert, _, key = value.removeprefix("tls:").partition(",")
        if not value.startswith("tls:") or not cert or not key:
            raise ConfigError(
                BENCHMARK_NATS_ENV, value, "a benchmark-only switch: 'open' or 'tls:CERT_FILE,KEY_FILE'"
            )
        return cls(tls_cert=cert, tls_key=key)


class EmbeddedFleet:
    """Starts and stops a private nats-server plus worker processes for one run.

    ``security`` is for benchmarks only (:class:`NatsSecurity`; None: ``RLFLEET_BENCHMARK_NATS``,
    which is normally unset: per-role credentials and permissions).
    """

    def __init__(
        self, run_dir: Path, *, jetstream: bool = False, security: NatsSecurity | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.jetstream = jetstream
        self.security = security if security is not None else NatsSecurity.from_env(os.environ)
        if self.security != NatsSecurity():
            logger.warning("benchmark-only NATS security for this run: %s", self.security)
        self.nats: EmbeddedNats | None = None
        self.workers: list[WorkerProcess] = []
        self.credentials: RunCredentials | None = None
        """The run's per-role NATS credentials, made by :meth:`start_nats` (None when open)."""

    def connection(self, role: str = "controller") -> NatsConnection:
        """How a client of ``role`` connects to this fleet's nats-server."""
        assert self.nats is not None, "start_nats() first"
        login = self.credentials.connection(role) if self.credentials is not None else NatsConnection()
        return login.model_copy(update={"tls_ca_file": self.security.tls_cert})

    @property
    def url(self) -> str:
        assert self.nats is not None, "start_nats() first"
        return self.nats.url

    @property
    def pids(self) -> list[int]:
        """Every process this fleet started and has not stopped yet (nats-server first)."""
        nats = [self.nats.pid] if self.nats is not None and self.nats.running else []
        return nats + [w.pid for w in self.workers]

    def start_nats(self, cluster: str = "*") -> str:
        """Start the private nats-server with fresh credentials for ``cluster`` (``*``: any)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.credentials = None if self.security.open else RunCredentials.generate(cluster)
        config = server_config(self.credentials) if self.credentials is not None else ""
        self.nats = EmbeddedNats(jetstream=self.jetstream, config=config, tls_cert=self.security.tls_cert,
                                 tls_key=self.security.tls_key)  # fmt: skip
        self.nats.start()
        logger.info("embedded nats-server pid %s at %s", self.nats.pid, self.nats.url)
        self._write_processes()
        return self.nats.url

    def spawn(self, spec: WorkerSpec) -> WorkerProcess:
        """Start one worker; its config gets this fleet's NATS URL."""
        config_dir = self.run_dir / "workers"
        config_dir.mkdir(parents=True, exist_ok=True)
        config_path = config_dir / f"{spec.worker_id}.yaml"
        config_path.write_text(yaml.safe_dump(spec.config_data(self.url), sort_keys=False))
        log_path = config_dir / f"{spec.worker_id}.log"
        program = list(spec.command) if spec.command else [find_script(spec.script)]
        command = [*program, "serve", "--config", str(config_path)]
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(NATS_ENV_PREFIX)}
        role = self.credentials.env(spec.tier) if self.credentials is not None and spec.tier in ROLES else {}
        if self.security.tls_cert:
            role[f"{NATS_ENV_PREFIX}TLS_CA_FILE"] = self.security.tls_cert
        env = {**inherited, "PYTHONUNBUFFERED": "1", **spec.env, **role}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
        logger.info("started %s worker %s (pid %d), log %s", spec.tier, spec.worker_id, process.pid, log_path)
        worker = WorkerProcess(spec, process, log_path)
        self.workers.append(worker)
        self._write_processes()
        return worker

    def _write_processes(self) -> None:
        """``processes.json``: what this fleet started, for operators and for tests."""
        data = {
            "controller_pid": os.getpid(),
            "nats": {"pid": self.nats.pid, "url": self.nats.url} if self.nats is not None else None,
            "workers": [
                {"tier": w.spec.tier, "worker_id": w.spec.worker_id, "pid": w.pid, "log": str(w.log_path)}
                for w in self.workers
            ],
        }
        path = self.run_dir / "processes.json"
        partial = path.with_suffix(".json.tmp")
        partial.write_text(json.dumps(data, indent=2))
        partial.replace(path)  # readers never see half a file

    def check(self) -> None:
        """Raise :class:`TierDied` if the nats-server or any worker process has exited."""
        if self.nats is not None and not self.nats.running:
            raise TierDied("nats", "nats-server", None, error="the embedded nats-server is gone")
        for worker in self.workers:
            died = worker.died()
            if died is not None:
                raise died

    def stop(self, timeout: float = 10.0) -> None:
        """Stop exactly the processes this fleet started: SIGTERM, wait, then SIGKILL their groups."""
        with _sigint_deferred():
            for worker in self.workers:
                if worker.process.poll() is None:
                    worker.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for worker in self.workers:
                try:
                    worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "worker %s did not stop in %.0fs; killing it", worker.spec.worker_id, timeout
                    )
                    _kill_group(worker.pid)
                    worker.process.wait(timeout=5)
                _kill_group(worker.pid)  # whatever the worker itself started and left behind
            self.workers.clear()
            if self.nats is not None:
                self.nats.stop()
                self.nats = None

    def __enter__(self) -> EmbeddedFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_group(pgid: int) -> None:
    """SIGKILL the process group a worker leads (it was started in a new session)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    except PermissionError as exc:
        logger.warning("cannot kill process group %d: %s", pgid, exc)
        return
    logger.info("killed what was left of process group %d", pgid)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it; taken again at once, so rarely raced)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def trainer_rank_specs(
    config: BaseModel | dict[str, Any], num_ranks: int, worker_id: str = "trainer-0"
) -> list[WorkerSpec]:
    """The trainer's processes: one worker, or ``num_ranks`` ranks on this host with the torchrun
    variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, and
    ``MASTER_PORT`` a free port). Rank 0 joins NATS as ``worker_id``; the others follow it."""
    if num_ranks == 1:
        return [WorkerSpec("trainer", worker_id, config)]
    shared = {"WORLD_SIZE": str(num_ranks), "LOCAL_WORLD_SIZE": str(num_ranks), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(free_port())}  # fmt: skip
    specs = []
    for rank in range(num_ranks):
        env = {**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        name = worker_id if rank == 0 else f"{worker_id}-rank{rank}"
        specs.append(WorkerSpec("trainer", name, config, env=env))
    return specs


# --- the event loop: synchronous calls into async fleet code, watched for dying processes ---------


class Watched(Protocol):
    """What the loop watches: the embedded launcher (``check`` raises TierDied for a dead process)."""

    def check(self) -> None: ...


class GuardedLoop:
    """One event loop for a run; ``watch()`` gives the launcher to check (None: nothing to watch)."""

    def __init__(self, watch: Callable[[], Watched | None]) -> None:
        self._watch = watch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop (a new one once the last was closed)."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine to its end, failing fast if a watched process dies."""
        task = self.loop.create_task(self._guarded(coro))
        self._tasks.add(task)  # kept if Ctrl-C leaves it pending, so close() can cancel it
        result = self.loop.run_until_complete(task)
        self._tasks.discard(task)
        return result

    def create_task(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Start ``coro`` in the background; it progresses while later calls run the loop."""
        return self.loop.create_task(coro, name=name)

    async def _guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` while watching; a request that fails because its worker died is reported as
        that death (:class:`TierDied`, caused by the request's error), not as its own error."""
        task = asyncio.ensure_future(coro)
        try:
            self._check()
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                self._check()
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # also when Ctrl-C left it failed
        error = None if task.cancelled() else task.exception()
        if error is not None and self._watch() is not None:
            try:
                for _ in range(10):  # a worker's sockets close a moment before its exit is visible
                    self._check()
                    await asyncio.sleep(0.1)
            except (TierDied, TierRefused) as died:
                raise died from error
        return task.result()

    def _check(self) -> None:
        watched = self._watch()
        if watched is not None:
            watched.check()

    def shutdown(self, leave: Callable[[], Awaitable[None]] | None) -> None:
        """Cancel what a Ctrl-C left running, await ``leave()`` (10 s at most), cancel what is left."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        _cancel(loop, list(self._tasks))
        self._tasks.clear()
        if leave is not None:
            try:
                loop.run_until_complete(asyncio.wait_for(leave(), timeout=10.0))
            except (ConnectionError, RuntimeError, TimeoutError) as exc:
                logger.debug("leaving the control plane: %s", exc)
        _cancel(loop, list(asyncio.all_tasks(loop)))

    def close(self) -> None:
        """Close the loop (idempotent)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()


def _cancel(loop: asyncio.AbstractEventLoop, tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
