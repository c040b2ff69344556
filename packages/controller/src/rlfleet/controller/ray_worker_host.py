"""One worker process inside a Ray actor (:class:`WorkerHost`), and the controller's handle on it
(:class:`RemoteProcess`, the part of ``subprocess.Popen`` the launcher uses).

The actor starts the tier's console script when it is made, so an actor that Ray restarts
(``max_restarts``, issue 13 point 2: its Ray worker process died) starts its worker process again
by itself, with the same command and config: the new process catches up to the trainer's current
weights before it announces (``rollout/catch_up.py``), so it rejoins at the current version. What
the dead actor left behind is ended first: its process got SIGTERM when the actor died
(``PR_SET_PDEATHSIG``), and the restarted actor SIGKILLs that process's group if it is still there
(found by the pid file it wrote, and only when that pid still runs the same config).

The handle tells three states apart: the actor answers (its process's exit code, or None while it
runs); Ray is restarting the actor (``ActorUnavailableError``: the process counts as running, the
launcher does not start another); the actor is gone for good (Ray gave up, or its node is gone:
the process counts as killed, and the launcher's own supervision takes over). A restarted actor
answers with another pid: :attr:`RemoteProcess.ray_restarts` counts those.

A worker process that is alive but frozen (stopped with SIGSTOP, hung) is declared dead by the
run's registry; the actor is then asked to SIGKILL it (:meth:`WorkerHost.kill_process`, only the
process of the pid the registry knew), and stays up so that the exit and the log are read through
it: the launcher starts the worker again in a fresh actor, within its restart budget (issue 29).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from rlfleet.common.atomic_files import write_atomic
from rlfleet.common.control.procs import die_with_parent
from rlfleet.common.schema.connection import ENV_PREFIX as NATS_ENV_PREFIX
from rlfleet.controller.launcher import tail_of
from rlfleet.controller.user_code import worker_pythonpath

logger = logging.getLogger(__name__)


def with_pythonpath(node: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """``node``'s environment updated with ``env``, whose ``PYTHONPATH`` (the run's code folders,
    :mod:`rlfleet.controller.user_code`) goes ahead of the node's own instead of replacing it."""
    merged = {**node, **env}
    if "PYTHONPATH" in env:
        merged["PYTHONPATH"] = worker_pythonpath(env["PYTHONPATH"].split(os.pathsep), node.get("PYTHONPATH"))
    return merged


class WorkerHost:
    """Runs one worker process on the node Ray placed this actor on (made a Ray actor by
    :func:`host_actor_class`). The process leads its own process group; the actor answers for it.

    ``launch``: the :meth:`start` arguments (command, config, env, work_dir, name, restart); given,
    the process starts with the actor, and again with every restart of it Ray makes."""

    def __init__(self, launch: dict[str, Any] | None = None) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = ""
        self.started: dict[str, Any] = {}
        if launch is not None:
            import ray

            again = ray.get_runtime_context().was_current_actor_reconstructed
            if again:  # a restart by Ray: end what the dead actor's process left, mark the log
                self._end_previous(Path(launch["work_dir"]), str(launch["name"]))
            self.start(**{**launch, "restart": launch.get("restart", 0), "by_ray": again})

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def start(self, command: list[str], config: dict[str, Any], env: dict[str, str], work_dir: str,
              name: str, restart: int, by_ray: bool = False) -> dict[str, Any]:  # fmt: skip
        """Write the config (this node's IP as the advertised host), start the process, say where.

        The process gets this node's environment without its ``RLFLEET_NATS_*``: its NATS login
        is the one in ``env`` (none for an open server), as with the embedded launcher."""
        ip = self.node_ip()
        config = {**config, "bind_host": "0.0.0.0", "advertise_host": ip}
        directory = Path(work_dir)
        directory.mkdir(parents=True, exist_ok=True)
        config_path = directory / f"{name}.yaml"
        write_atomic(config_path, yaml.safe_dump(config, sort_keys=False))
        self.log_path = str(directory / f"{name}.log")
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(NATS_ENV_PREFIX)}
        with open(self.log_path, "ab" if restart or by_ray else "wb") as log:
            if restart or by_ray:
                what = "restarted by ray (its actor died)" if by_ray else f"restart {restart} of {name} (ray)"
                log.write(f"\n--- rlfleet: {what} ---\n".encode())
                log.flush()
            self.process = subprocess.Popen(
                [*command, "serve", "--config", str(config_path)], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=with_pythonpath(inherited, env), start_new_session=True,
                preexec_fn=die_with_parent,  # SIGTERM when this actor's process dies
            )  # fmt: skip
        write_atomic(directory / f"{name}.pid", f"{self.process.pid} {config_path}\n")
        import ray

        node = ray.get_runtime_context().get_node_id()
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.started = {"pid": self.process.pid, "node_ip": ip, "node_id": node, "host": socket.gethostname(),
                        "log": self.log_path, "cuda_visible_devices": gpus,
                        "actor_pid": os.getpid()}  # fmt: skip
        return self.started

    @staticmethod
    def _end_previous(directory: Path, name: str) -> None:
        """SIGKILL the group of the process a dead incarnation of this actor started, if it still
        runs that worker's config (a pid reused by another program is left alone)."""
        try:
            pid_text, config_path = (directory / f"{name}.pid").read_text().split(maxsplit=1)
            cmdline = Path(f"/proc/{int(pid_text)}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            return
        if config_path.strip() in cmdline:
            try:
                os.killpg(int(pid_text), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def describe(self) -> dict[str, Any]:
        """Where the process runs (as :meth:`start` returned it)."""
        return self.started

    def status(self) -> tuple[int | None, int | None]:
        """``(pid, exit code or None while it runs)``; another pid than before: Ray restarted the actor."""
        if self.process is None:
            return None, None
        return self.process.pid, self.process.poll()

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def wait(self, timeout: float) -> int | None:
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def kill_process(self, pid: int) -> bool:
        """SIGKILL this actor's worker process group if ``pid`` is that process and it still runs (a
        frozen worker the run declared dead); True when it was killed."""
        process = self.process
        if process is None or process.pid != pid or process.poll() is not None:
            return False
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return False
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return True

    def kill_group(self) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def log_tail(self, lines: int) -> str:
        return tail_of(self.log_path, lines)


def host_actor_class(ray: Any, max_restarts: int = 0) -> Any:
    """:class:`WorkerHost` as a Ray actor class that Ray restarts ``max_restarts`` times (0: never,
    the launcher's policy decides)."""
    return ray.remote(max_restarts=max_restarts, max_concurrency=4)(WorkerHost)


class RemoteProcess:
    """The part of :class:`subprocess.Popen` the launcher uses, for a process a :class:`WorkerHost` runs."""

    def __init__(self, ray: Any, actor: Any, pid: int) -> None:
        self._ray, self.actor, self.pid = ray, actor, pid
        self.returncode: int | None = None
        self.ray_restarts = 0
        """Times the actor went down and Ray restarts it (each starts the process again)."""
        self.down = False
        """Ray is restarting the actor now (it answered ``ActorUnavailableError``)."""

    def _call(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        return self._ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, self.returncode = self._call("status")
            except self._ray.exceptions.ActorUnavailableError:
                if not self.down:  # Ray is restarting the actor: it starts the process again
                    self.down, self.ray_restarts = True, self.ray_restarts + 1
                return None
            except Exception:  # noqa: BLE001 - the actor (its node) is gone for good: so is the process
                self.returncode = -int(signal.SIGKILL)
                return self.returncode
            if pid is not None and pid != self.pid:
                logger.warning("ray restarted the actor of pid %d; its process is pid %d", self.pid, pid)
                self.pid, self.ray_restarts = pid, self.ray_restarts + (0 if self.down else 1)
            self.down = False
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        bound = 3600.0 if timeout is None else timeout
        deadline = time.monotonic() + bound
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired("ray worker", bound)
            try:
                self._call("wait", min(left, 5.0), timeout=min(left, 5.0) + 30)
            except Exception:  # noqa: BLE001
                time.sleep(min(left, 0.5))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        try:
            self._call("signal", int(signum))
        except Exception as exc:  # noqa: BLE001 - already gone
            logger.info("signal to ray worker pid %d not delivered: %s", self.pid, exc)

    def kill_process(self, pid: int) -> bool:
        """Have the actor SIGKILL its process ``pid`` (it stays up: the exit is read through it)."""
        try:
            return bool(self._call("kill_process", int(pid)))
        except Exception as exc:  # noqa: BLE001 - the actor is gone: so is the process
            logger.info("ray worker pid %d not killed through its actor: %s", pid, exc)
            return False

    def kill_group(self) -> None:
        try:
            self._call("kill_group")
        except Exception:  # noqa: BLE001 - already gone
            pass
        try:
            self._ray.kill(self.actor)  # no_restart: a worker the launcher stops stays stopped
        except Exception:  # noqa: BLE001
            pass
