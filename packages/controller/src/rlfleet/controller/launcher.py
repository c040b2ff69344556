"""Start, watch and restart the processes of a run: its own nats-server and its workers.

:class:`EmbeddedFleet` (the default launcher) runs a private nats-server and every tier as a local
process. It and :class:`~rlfleet.controller.ray_launcher.RayFleet` implement the run's
:class:`~rlfleet.controller.ports.Launcher` side by side; what they share, they share through a
member, :class:`RunProcesses` (the server, the workers, their restarts, ``processes.json``,
stopping), and differ only in how one worker process is started (a ``Popen`` here, a Ray actor there).

**The server.** Every embedded run gets a private nats-server that takes only the run's generated
credentials, one per role, each allowed only its role's subjects
(:mod:`rlfleet.common.control.nats_roles`); each worker gets its own role's credential in its
environment (``RLFLEET_NATS_*``, not argv, so ``ps`` does not show it). :class:`NatsSecurity` holds
the benchmark-only ways to run it otherwise (open, or with TLS too), for
``benchmarks/security_overhead.py``. The server must be started from the thread that keeps running
(the run's main thread): it dies with the thread that forked it.

**The workers.** Each worker is started through its console script (``rlfleet-rollout serve
--config ...``), with its config (the tier's schema object, validated, or a dict) written as YAML in
the previous release's flat form (which workers of both releases read) and its output captured in a
log file under the run directory; the pids go to ``processes.json`` there.
The launcher stops exactly the processes it started (each worker leads its own process group, so
whatever a worker spawned goes with it): on normal exit, on Ctrl-C and on error; stopping waits for
each worker's drain (its ``drain_s``) before it kills it. Workers also get SIGTERM from the kernel
if the thread that started them dies (``PR_SET_PDEATHSIG``), so a controller killed outright does
not leave them running. One worker (the first section): what to start (:class:`WorkerSpec`), the
started process (:class:`WorkerProcess`: its pid, its log, and the error its exit reads as: the
line of a crashed worker's log that says why), the console script to run, and killing what a
worker's process group left behind; the Ray launcher reuses the spec and the log reading.

**Supervision** (issue 12). :meth:`EmbeddedFleet.check`, which the run's event loop calls four
times a second (:class:`~rlfleet.controller.supervision.GuardedLoop`), starts a crashed rollout or
reward worker again under the same id and config, up to ``restart_budget`` times per worker, and
tells ``on_restart`` (the run forgets the dead process and waits for the new one to announce; a
rollout worker loads the current weights before it announces). The trainer is restarted only when
the run asks (:meth:`EmbeddedFleet.restart_tier`: it must be restored from a checkpoint); any other
exit, an exit with code 2 (the worker refused its settings) and a crash past the budget raise. A
worker that does not exit but says nothing (stopped with SIGSTOP, hung) is declared dead by the
run's membership registry; when its process still runs, the run has it killed
(:func:`kill_declared_dead`: SIGKILL of the process group the launcher started, only when the pid
the registry knew is that process's), and the check above then starts it again like any crashed
worker, counted against the same budget (issue 29). A
nats-server that exits is started again on the port it had, with the same generated configuration
(the same credentials and permissions, the same TLS files), so every client reconnects to the URL
it knows (the transport reconnects and sends again what nobody took; the registry does not count
the outage against anyone's heartbeats); it counts against the same budget, and past it, or when it
cannot be started again, the run stops with :class:`~rlfleet.controller.errors.TierNotRestarted`.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from rlfleet.common.atomic_files import write_atomic
from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.nats_roles import ROLES, RunCredentials, server_config
from rlfleet.common.control.procs import die_with_parent
from rlfleet.common.control.worker import USER_ERROR_EXIT
from rlfleet.common.errors import ConfigError, NatsServerError
from rlfleet.common.schema.config import legacy_dump
from rlfleet.common.schema.connection import ENV_PREFIX as NATS_ENV_PREFIX
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.common.schema.worker import ServiceConfig
from rlfleet.controller.errors import TierDied, TierNotRestarted, TierRefused
from rlfleet.controller.gpu_assignment import GPU_ENV, GpuAssignment
from rlfleet.controller.user_code import code_dirs, worker_pythonpath

logger = logging.getLogger(__name__)

NATS_ID = "nats-server"
"""The id the run's nats-server goes by in errors, restart counts and ``processes.json``."""

BENCHMARK_NATS_ENV = "RLFLEET_BENCHMARK_NATS"
"""Benchmark-only: ``open`` or ``tls:CERT_FILE,KEY_FILE`` (see :class:`NatsSecurity`)."""

SUPERVISED_TIERS = ("rollout", "reward")
"""Tiers whose crashed workers a launcher's ``check`` starts again on its own (a trainer needs its
state restored: the run restarts it, ``restart_tier``)."""


# --- one started worker: is it running, and if not, what its exit and its log say --------------------

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
        """What the worker's config file holds: its config, joining ``nats_url`` as ``worker_id``.

        It is written in the previous release's flat form (:func:`~rlfleet.common.schema.config.legacy_dump`;
        a plain dict as it is given), with only the settings that differ from their defaults, so a
        worker of the previous release, which refuses settings it does not know, still reads a
        newer controller's file while the newer settings keep their defaults (tests/compat); a
        worker of this release reads the flat form too."""
        config = legacy_dump(self.config) if isinstance(self.config, BaseModel) else dict(self.config)
        config.pop("nats_auth", None)  # credentials travel in the environment, never in a file
        return {**config, "nats_url": nats_url, "worker_id": self.worker_id}


def tail_of(path: str | Path, lines: int) -> str:
    """The last ``lines`` lines of a log file ("" when it cannot be read)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


@dataclass
class WorkerProcess:
    """A started worker: its spec, process and log file."""

    spec: WorkerSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    declared_dead: str = field(default="", kw_only=True)
    """Why the launcher killed this process while it ran ('' unless it did): its exit's error."""

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 15) -> str:
        return tail_of(self.log_path, lines)

    def died(self) -> TierDied | TierRefused | None:
        """The error describing this worker's exit, or None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        tail = self.log_tail(40)
        error = self.declared_dead if code < 0 else last_error_line(tail)  # a signal: no line says why
        kind = TierRefused if code == USER_ERROR_EXIT else TierDied  # exit 2: the worker refused its settings
        return kind(
            self.spec.tier, self.spec.worker_id, code, error=error, log_path=self.log_path, log_tail=tail
        )

    def kill_group(self) -> None:
        """SIGKILL what is left of the worker's process group (it leads one)."""
        kill_group(self.pid)

    def kill_declared_dead(self, why: str) -> None:
        """SIGKILL the running worker (``why``: what its exit will read as); the launcher's next
        check sees it exit and starts it again."""
        self.declared_dead = why
        self.kill_group()

    def runs_pid(self, pid: int) -> bool:
        """Whether ``pid`` (as the worker announced it) is this worker's process or one of its group."""
        if pid <= 0:
            return False
        if pid == self.pid:
            return True
        try:
            return os.getpgid(pid) == self.pid  # started through a wrapper: the worker leads the group
        except (ProcessLookupError, PermissionError):
            return False

    def describe(self) -> str:
        """``rollout worker rollout-0 (pid 12, still running; log: ...)`` for error messages."""
        code = self.process.poll()
        state = "still running" if code is None else f"exited with code {code}"
        return (
            f"{self.spec.tier} worker {self.spec.worker_id} (pid {self.pid}, {state}; log: {self.log_path})"
        )


def starting_line(specs: Sequence[WorkerSpec]) -> str:
    """The console line a run prints as it starts its workers: ``starting 3 workers: trainer-0,
    rollout-0, reward-0`` (a worker whose name does not say its tier: ``fast-0 (rollout)``)."""
    names = ", ".join(
        spec.worker_id if spec.worker_id.startswith(spec.tier) else f"{spec.worker_id} ({spec.tier})"
        for spec in specs
    )
    return f"starting {len(specs)} worker{'s' if len(specs) != 1 else ''}: {names}"


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


def script_variable(name: str) -> str:
    """The environment variable that points the launcher at another program for the console script
    ``name``: ``rlfleet-rollout`` -> ``RLFLEET_ROLLOUT_SCRIPT``."""
    return name.upper().replace("-", "_") + "_SCRIPT"


def find_script(name: str) -> str:
    """A console script of this environment: next to the running interpreter first, then PATH.

    ``RLFLEET_<TIER>_SCRIPT`` (:func:`script_variable`), when set, names the program to run instead,
    e.g. a tier installed in another environment (the wire compatibility tests run an older
    release's ``rlfleet-rollout`` this way); it must be an executable file.
    """
    chosen = os.environ.get(script_variable(name), "")
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise FileNotFoundError(f"{script_variable(name)}={chosen!r} is not an executable file")
        return chosen
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


def kill_declared_dead(
    workers: Sequence[WorkerProcess], tier: str, worker_id: str, pid: int, silent_s: float
) -> WorkerProcess | None:
    """Kill the process of a rollout or reward worker that the membership registry declared dead
    (``silent_s`` without a heartbeat) while it still runs, stopped or hung: SIGKILL, so the
    launcher's next check starts it again within its restart budget. ``pid`` is what the worker
    announced: a process started since (a restart) is never touched. Returns the worker killed."""
    if tier not in SUPERVISED_TIERS:
        return None  # a trainer is restored by the run, from a checkpoint; never killed behind its back
    for worker in workers:
        if worker.spec.worker_id != worker_id or worker.process.poll() is not None:
            continue
        if not worker.runs_pid(pid):
            logger.warning("%s worker %s was declared dead as pid %d, but the launcher's process is pid %d: "
                           "left alone", tier, worker_id, pid, worker.pid)  # fmt: skip
            return None
        why = (f"declared dead after {silent_s:.1f}s without a heartbeat while its process still ran "
               "(stopped or hung); killed by the launcher")  # fmt: skip
        logger.warning("%s worker %s (pid %d): %s", tier, worker_id, worker.pid, why)
        worker.kill_declared_dead(why)
        return worker
    return None


def kill_group(pgid: int) -> None:
    """SIGKILL the process group a worker leads (it was started in a new session)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    except PermissionError as exc:
        logger.warning("cannot kill process group %d: %s", pgid, exc)
        return
    logger.info("killed what was left of process group %d", pgid)


# --- the run's nats-server --------------------------------------------------------------------------


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


def run_security(security: NatsSecurity | None) -> NatsSecurity:
    """``security``, or the default unless ``RLFLEET_BENCHMARK_NATS`` says otherwise (a warning then)."""
    security = security if security is not None else NatsSecurity.from_env(os.environ)
    if security != NatsSecurity():
        logger.warning("benchmark-only NATS security for this run: %s", security)
    return security


def start_run_nats(
    security: NatsSecurity, cluster: str, *, jetstream: bool, host: str = "127.0.0.1"
) -> tuple[EmbeddedNats, RunCredentials | None]:
    """Start a run's nats-server on ``host`` with fresh credentials for ``cluster`` (``*``: any;
    none when open)."""
    credentials = None if security.open else RunCredentials.generate(cluster)
    config = server_config(credentials) if credentials is not None else ""
    nats = EmbeddedNats(jetstream=jetstream, config=config, host=host, tls_cert=security.tls_cert,
                        tls_key=security.tls_key)  # fmt: skip
    nats.start()
    logger.info("embedded nats-server pid %s at %s", nats.pid, nats.url)
    return nats, credentials


def nats_died(nats: EmbeddedNats) -> TierDied | None:
    """The death of the run's nats-server, or None while it runs."""
    code = nats.returncode
    if code is None:
        return None
    return TierDied("nats", NATS_ID, code, error=f"the run's own nats-server at {nats.url} is gone")


def restart_nats(nats: EmbeddedNats, died: TierDied, used: int, budget: int) -> int:
    """Start ``nats`` again on its port with the same configuration; returns the restarts used.

    Raises ``died`` when the budget is 0 (no supervision) and :class:`TierNotRestarted` when it is
    spent or the server does not come back (its port taken meanwhile, the binary gone...)."""
    if budget == 0:
        raise died
    if used >= budget:
        raise TierNotRestarted(died, f"its restart budget is spent ({used} of faults.restart_budget={budget} "
                               "restarts used)")  # fmt: skip
    url = nats.url
    logger.warning("%s; starting it again on the same port (restart %d of %d)", died, used + 1, budget)
    nats.stop(keep_port=True)
    try:
        nats.start()
    except NatsServerError as exc:
        raise TierNotRestarted(died, f"it could not be started again at {url}: {exc}") from exc
    logger.warning("embedded nats-server is back at %s (pid %d); clients reconnect", nats.url, nats.pid)
    return used + 1


# --- what every launcher shares ---------------------------------------------------------------------


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


StartWorker = Callable[[WorkerSpec, int], WorkerProcess]
"""How a launcher starts one worker process: ``start(spec, restart)`` (``restart``: 0 the first
time, then the number of that restart)."""


class RunProcesses:
    """The processes a launcher started for one run, however it starts them: the part every launcher
    shares (each holds one). The run's own nats-server (:meth:`start_nats`), or the URL of one it
    joins (:meth:`join_nats`); the workers (:meth:`spawn`), each crashed rollout or reward worker
    started again within ``restart_budget`` (:meth:`restarted`), a tier restarted on request
    (:meth:`restart_tier`); ``processes.json`` in ``run_dir``; stopping them all (:meth:`stop`).

    ``start`` starts one worker process the launcher's way; ``record(worker)`` is a worker's line of
    ``processes.json`` (:func:`worker_record`, or more)."""

    def __init__(
        self, run_dir: Path, *, security: NatsSecurity, restart_budget: int, start: StartWorker,
        record: Callable[[WorkerProcess], dict[str, Any]],
    ) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.security = security
        self.restart_budget = restart_budget
        """Restarts of each crashed worker over the run (0: any crash raises)."""
        self.nats: EmbeddedNats | None = None
        self.credentials: RunCredentials | None = None
        """The run's per-role NATS credentials, made by :meth:`start_nats` (None when open)."""
        self.workers: list[WorkerProcess] = []
        self.restarts: dict[str, int] = {}
        """Restarts so far, by worker id (a trainer's ranks count under rank 0's id)."""
        self.outside_url: str | None = None
        self._advertise = ""
        self._start = start
        self._record = record

    # --- the server ------------------------------------------------------------------------------

    def start_nats(
        self, cluster: str, *, jetstream: bool, host: str = "127.0.0.1", advertise: str = ""
    ) -> str:
        """Start the private nats-server on ``host`` with fresh credentials for ``cluster`` (``*``:
        any); its URL names ``advertise`` (an address other machines reach) when given."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._advertise = advertise
        self.nats, self.credentials = start_run_nats(self.security, cluster, jetstream=jetstream, host=host)
        self.write()
        return self.url

    def join_nats(self, url: str) -> None:
        """Use the nats-server at ``url`` instead of starting one (workers get ``url`` as given)."""
        self.outside_url = url

    @property
    def url(self) -> str:
        if self.outside_url is not None:
            return self.outside_url
        assert self.nats is not None and self.nats.port is not None, "start_nats() first"
        return f"nats://{self._advertise}:{self.nats.port}" if self._advertise else self.nats.url

    def connection(self, role: str) -> NatsConnection:
        """How a client of ``role`` connects to the run's own nats-server."""
        assert self.nats is not None, "start_nats() first"
        login = self.credentials.connection(role) if self.credentials is not None else NatsConnection()
        return login.model_copy(update={"tls_ca_file": self.security.tls_cert})

    @property
    def pids(self) -> list[int]:
        """Every process started and not stopped yet (nats-server first)."""
        nats = [self.nats.pid] if self.nats is not None and self.nats.running else []
        return nats + [w.pid for w in self.workers]

    # --- the workers -----------------------------------------------------------------------------

    def spawn(self, spec: WorkerSpec) -> WorkerProcess:
        """Start one worker; supervised from now on."""
        worker = self._start(spec, 0)
        self.workers.append(worker)
        self.write()
        return worker

    def write(self) -> None:
        """``processes.json``: what was started, for operators and for tests."""
        nats: dict[str, Any] | None = None
        if self.nats is not None and self.nats.port is not None:
            nats = {"pid": self.nats.pid, "url": self.url}
            if self.restarts.get(NATS_ID):
                nats["restarts"] = self.restarts[NATS_ID]
        data = {
            "controller_pid": os.getpid(),
            "nats": nats,
            "workers": [self._record(w) for w in self.workers],
        }
        write_atomic(self.run_dir / "processes.json", json.dumps(data, indent=2))  # never half a file

    def restarted(self) -> Iterator[tuple[WorkerProcess, TierDied]]:
        """Restart the nats-server and each crashed rollout or reward worker (within the budget),
        yielding each worker started again with its death (the launcher tells the run before the
        next one is looked at); raise :class:`TierDied` for any other exit, and past the budget."""
        gone = nats_died(self.nats) if self.nats is not None else None
        if gone is not None:  # the same port and configuration: every client reconnects to it
            assert self.nats is not None
            self.restarts[NATS_ID] = restart_nats(self.nats, gone, self.restarts.get(NATS_ID, 0),
                                                  self.restart_budget)  # fmt: skip
            self.write()
        for i, worker in enumerate(self.workers):
            died = worker.died()
            if died is None:
                continue
            if isinstance(died, TierRefused) or worker.spec.tier not in SUPERVISED_TIERS:
                raise died
            self._spend_restart(worker.spec.worker_id, died)
            worker.kill_group()  # whatever the dead worker started and left behind
            self.workers[i] = self._start(worker.spec, self.restarts[worker.spec.worker_id])
            self.write()
            yield self.workers[i], died

    def _spend_restart(self, worker_id: str, died: TierDied) -> None:
        """Count one restart of ``worker_id``, or raise when its budget is spent (0: ``died`` itself)."""
        used = self.restarts.get(worker_id, 0)
        if self.restart_budget == 0:
            raise died
        if used >= self.restart_budget:
            raise TierNotRestarted(died, f"its restart budget is spent ({used} of faults.restart_budget="
                                   f"{self.restart_budget} restarts used)")  # fmt: skip
        self.restarts[worker_id] = used + 1
        logger.warning("%s; starting it again (restart %d of %d)", died, used + 1, self.restart_budget)

    def restart_tier(self, tier: str, died: TierDied) -> list[WorkerProcess]:
        """Stop every process of ``tier`` (a trainer's ranks fall together) and start them again,
        ranks on a fresh rendezvous port; counts as one restart of its first worker. ``died`` is
        the death that asks for it (raised, as :class:`TierNotRestarted`, past the budget)."""
        group = [i for i, w in enumerate(self.workers) if w.spec.tier == tier]
        if not group:
            raise died
        first = self.workers[group[0]].spec.worker_id
        self._spend_restart(first, died)
        for i in group:
            self.workers[i].kill_group()
            self.workers[i].process.wait(timeout=10)
        port = {"MASTER_PORT": str(free_port())}
        for i in group:
            spec = self.workers[i].spec
            if "MASTER_PORT" in spec.env:
                spec = replace(spec, env={**spec.env, **port})
            self.workers[i] = self._start(spec, self.restarts[first])
        self.write()
        return [self.workers[i] for i in group]

    def retire(self, workers: Sequence[WorkerProcess]) -> None:
        """Stop supervising ``workers`` (their exit is no crash); ``processes.json`` lists what still runs."""
        for worker in workers:
            self.workers.remove(worker)
        self.write()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop exactly the processes started: SIGTERM, wait, then SIGKILL their groups.

        A worker SIGTERMed drains first (its requests in progress get its ``drain_s`` to finish), so
        each is waited for up to its own ``drain_s`` plus ``timeout`` before it is killed."""
        with _sigint_deferred():
            for worker in self.workers:
                if worker.process.poll() is None:
                    worker.process.send_signal(signal.SIGTERM)
            start = time.monotonic()
            for worker in self.workers:
                bound = drain_bound(worker.spec) + timeout
                try:
                    worker.process.wait(timeout=max(0.1, start + bound - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("worker %s did not stop in %.0fs (drain_s and %.0f s more); killing it",
                                   worker.spec.worker_id, bound, timeout)  # fmt: skip
                    worker.kill_group()
                    worker.process.wait(timeout=5)
                worker.kill_group()  # whatever the worker itself started and left behind
            self.workers.clear()
            if self.nats is not None:
                self.nats.stop()
                self.nats = None


def worker_record(worker: WorkerProcess, restarts: Mapping[str, int]) -> dict[str, Any]:
    """A worker's line of ``processes.json`` (``restarts`` once it was started again)."""
    record: dict[str, Any] = {"tier": worker.spec.tier, "worker_id": worker.spec.worker_id,
                              "pid": worker.pid, "log": str(worker.log_path)}  # fmt: skip
    if restarts.get(worker.spec.worker_id):
        record["restarts"] = restarts[worker.spec.worker_id]
    return record


# --- the embedded launcher --------------------------------------------------------------------------


class EmbeddedFleet:
    """Starts and stops a private nats-server plus worker processes for one run, on this machine.

    ``security`` is for benchmarks only (:class:`NatsSecurity`; None: ``RLFLEET_BENCHMARK_NATS``,
    which is normally unset: per-role credentials and permissions). ``restart_budget``: restarts
    of each crashed worker over the run (0: any crash raises, as before supervision). ``gpus``:
    each worker's ``CUDA_VISIBLE_DEVICES`` (:func:`~rlfleet.controller.gpu_assignment.assignment_for`;
    None, as on a CPU-only machine: the controller's environment is passed on unchanged).
    ``python_path``: folders of the user's code, on every worker's ``PYTHONPATH`` after the
    working directory (:mod:`rlfleet.controller.user_code`).
    """

    def __init__(
        self, run_dir: Path, *, jetstream: bool = False, security: NatsSecurity | None = None,
        restart_budget: int = 0, gpus: GpuAssignment | None = None, python_path: Sequence[str] = (),
    ) -> None:  # fmt: skip
        self.code_dirs = code_dirs(python_path)
        """Put first on every worker's ``PYTHONPATH``: a reward spec's ``module:function`` imports there."""
        self.jetstream = jetstream
        self.gpus = gpus
        """Each worker's ``CUDA_VISIBLE_DEVICES`` (:mod:`rlfleet.controller.gpu_assignment`); None: unset."""
        self.processes = RunProcesses(
            Path(run_dir),
            security=run_security(security),
            restart_budget=restart_budget,
            start=self._start,
            record=self._record,
        )
        """The server, the workers, their restarts, ``processes.json``."""
        self.on_restart: Callable[[WorkerProcess, TierDied], None] | None = None
        """Called (in :meth:`check`) with each rollout or reward worker started again and its death;
        what it raises, :meth:`check` raises."""

    @property
    def workers(self) -> list[WorkerProcess]:
        return self.processes.workers

    @property
    def url(self) -> str:
        return self.processes.url

    @property
    def pids(self) -> list[int]:
        """Every process this fleet started and has not stopped yet (nats-server first)."""
        return self.processes.pids

    def connection(self, role: str = "controller") -> NatsConnection:
        """How a client of ``role`` connects to this fleet's nats-server."""
        return self.processes.connection(role)

    def start_nats(self, cluster: str = "*") -> str:
        """Start the private nats-server on loopback with fresh credentials for ``cluster`` (``*``: any)."""
        return self.processes.start_nats(cluster, jetstream=self.jetstream)

    def spawn(self, spec: WorkerSpec) -> WorkerProcess:
        """Start one worker; its config gets this fleet's NATS URL."""
        return self.processes.spawn(spec)

    def _start(self, spec: WorkerSpec, restart: int = 0) -> WorkerProcess:
        """Start ``spec``'s process; a restart appends to the worker's log after a marker line."""
        processes = self.processes
        config_dir = processes.run_dir / "workers"
        config_dir.mkdir(parents=True, exist_ok=True)
        config_path = config_dir / f"{spec.worker_id}.yaml"
        write_atomic(config_path, yaml.safe_dump(spec.config_data(self.url), sort_keys=False))
        log_path = config_dir / f"{spec.worker_id}.log"
        program = list(spec.command) if spec.command else [find_script(spec.script)]
        command = [*program, "serve", "--config", str(config_path)]
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(NATS_ENV_PREFIX)}
        credentials = processes.credentials
        role = credentials.env(spec.tier) if credentials is not None and spec.tier in ROLES else {}
        if processes.security.tls_cert:
            role[f"{NATS_ENV_PREFIX}TLS_CA_FILE"] = processes.security.tls_cert
        env = {**inherited, "PYTHONUNBUFFERED": "1", **spec.env, **role}
        env["PYTHONPATH"] = worker_pythonpath(self.code_dirs, env.get("PYTHONPATH"))
        if self.gpus is not None:
            live = {w.spec.worker_id for w in self.workers}
            env.update(self.gpus.env_for(spec.tier, spec.worker_id, spec.config, spec.env, live))
        with open(log_path, "ab" if restart else "wb") as log:
            if restart:
                log.write(f"\n--- rlfleet: restart {restart} of {spec.worker_id} ---\n".encode())
                log.flush()
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
        logger.info("started %s worker %s (pid %d%s), log %s", spec.tier, spec.worker_id, process.pid,
                    f", {GPU_ENV}={env[GPU_ENV]!r}" if self.gpus is not None else "", log_path)  # fmt: skip
        return WorkerProcess(spec, process, log_path)

    def _record(self, worker: WorkerProcess) -> dict[str, Any]:
        """A worker's line of ``processes.json``, with the GPUs it was given."""
        record = worker_record(worker, self.processes.restarts)
        if self.gpus is not None and worker.spec.worker_id in self.gpus.held:
            record["cuda_visible_devices"] = ",".join(self.gpus.held[worker.spec.worker_id])
        return record

    def check(self) -> None:
        """Restart the nats-server and each crashed rollout or reward worker (within its budget,
        telling ``on_restart`` of a worker); raise :class:`TierDied` for any other exit, and past
        the budget."""
        for worker, died in self.processes.restarted():
            if self.on_restart is not None:
                self.on_restart(worker, died)

    def restart_tier(self, tier: str, died: TierDied) -> list[WorkerProcess]:
        """Stop every process of ``tier`` and start them again (:meth:`RunProcesses.restart_tier`)."""
        return self.processes.restart_tier(tier, died)

    def retire(self, workers: Sequence[WorkerProcess]) -> None:
        """Stop supervising ``workers``; the caller stops them."""
        self.processes.retire(workers)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop exactly the processes this fleet started (:meth:`RunProcesses.stop`)."""
        self.processes.stop(timeout)

    def __enter__(self) -> EmbeddedFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- helpers ------------------------------------------------------------------------------------


def drain_bound(spec: WorkerSpec) -> float:
    """How long ``spec``'s worker may drain once SIGTERMed: its config's ``drain_s``; when the config
    does not set it, the schema's default for a tier's own console script, 0 for another command
    (nothing says it drains)."""
    config = spec.config
    value = config.get("drain_s") if isinstance(config, dict) else getattr(config, "drain_s", None)
    default = 0.0 if spec.command else ServiceConfig.model_fields["drain_s"].default
    try:
        return max(0.0, float(value if value is not None else default))
    except (TypeError, ValueError):
        return float(default)


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
