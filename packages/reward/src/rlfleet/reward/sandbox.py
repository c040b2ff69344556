"""Runs model-written code (the ``python`` tool) in another process, under limits, without network.

:meth:`Sandbox.run` starts ``python -I -S`` on :mod:`rlfleet.reward.sandbox_child` (never in the
worker's own process): an empty environment (nothing of the worker's variables, its tokens
included), a fresh temporary working directory removed afterwards, no stdin, its own session so
that a wall-clock overrun kills every process it started (``killpg`` on the pid it was given). Its
limits are :class:`~rlfleet.common.schema.reward.SandboxLimits`: CPU seconds, address space, file
size, output kept (the rest is counted and cut) and wall-clock seconds. Each limit hit is a field
of the :class:`SandboxResult` and a sentence of :meth:`SandboxResult.problem`.

Isolation, in layers (:attr:`Sandbox.isolation` lists those in use):

- ``namespaces``: ``unshare --user --map-root-user --net --mount --pid --fork --mount-proc``, where
  the host allows unprivileged user namespaces (probed once per process by running it; a worker
  running as root leaves out the user namespace): no network interface but a downed loopback, and
  a ``/proc`` that shows only the sandbox's own processes, so the worker's environment, memory and
  signals are out of reach;
- ``nobody``: a worker running as root runs the code as uid and gid 65534, where that user can run
  the worker's Python (probed once; else the namespaces keep the user namespace, whose root has no
  power outside it);
- ``seccomp``: a filter refusing ``socket`` (and ``ptrace``, the signal calls, ``io_uring``...) with
  EACCES, where the kernel and machine allow (probed once);
- ``imports``: the network and process modules cannot be imported (always; the layer that gives a
  clear message, not a boundary on its own).

Without ``namespaces`` the code still has no network, but it runs as the worker's user (unless
``nobody`` applies) and can read what that user can, ``/proc/<worker pid>/`` included: a shared
server sets ``namespaces: required``. With them it can still read the files that user can read
(as their owner, for a root worker in a user namespace): run a shared server as its own user.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlfleet.common.schema.reward import SandboxLimits
from rlfleet.reward import sandbox_child
from rlfleet.reward.errors import SandboxUnavailable

logger = logging.getLogger(__name__)

CHILD_SCRIPT = str(Path(sandbox_child.__file__).resolve())
NAMESPACE_FLAGS = ("--net", "--mount", "--pid", "--fork", "--mount-proc")
USER_NAMESPACE_FLAGS = ("--user", "--map-root-user", *NAMESPACE_FLAGS)
"""What a worker that is not root runs the code under (root may make the others without a user namespace)."""
NOBODY = 65534
"""The uid and gid a root worker's code runs as."""
PYTHON_FLAGS = ("-I", "-S", "-u", "-X", "utf8")
"""Isolated mode (no user site, no PYTHON* variables, no cwd on the path), no site-packages,
unbuffered output (a limit that ends the code with ``os._exit`` loses nothing it printed)."""
PROBE_S = 20.0


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended: its output (stdout and stderr, interleaved, cut at ``output_bytes``) and
    every limit it hit."""

    output: str
    exit_code: int | None
    """The code's exit status (negative: the signal that killed it); None when it never reported."""
    limits: SandboxLimits
    timed_out: Literal["", "cpu", "wall"] = ""
    memory_exceeded: bool = False
    network_refused: bool = False
    output_bytes: int = 0
    """Bytes of output the code wrote, kept or not."""
    seconds: float = 0.0
    cpu_s: float = 0.0

    @property
    def output_truncated(self) -> bool:
        return self.output_bytes > self.limits.output_bytes

    @property
    def ok(self) -> bool:
        """Ran to the end (exit status 0) within every limit."""
        return self.exit_code == 0 and not self.problem()

    def problem(self) -> str:
        """What went wrong, in sentences ('' when nothing did)."""
        lim, parts = self.limits, []
        if self.timed_out == "wall":
            parts.append(f"timed out: the wall-clock limit of {lim.wall_s:g} s was reached and it was killed")
        elif self.timed_out == "cpu":
            parts.append(f"timed out: the CPU time limit of {lim.cpu_s} s was reached")
        if self.memory_exceeded:
            parts.append(f"killed: the memory limit of {lim.memory_mb} MiB was reached")
        if self.network_refused:
            parts.append("network access is refused in this sandbox")
        if self.output_truncated:
            parts.append(
                f"output truncated: {self.output_bytes} bytes written, the first {lim.output_bytes} kept"
            )
        if not parts and self.exit_code is None:
            parts.append("the sandbox ended without a report")
        elif not parts and self.exit_code == sandbox_child.EXIT_SETUP:
            parts.append("the sandbox could not be set up")
        elif not parts and self.exit_code is not None and self.exit_code < 0:
            parts.append(f"killed by signal {signal.Signals(-self.exit_code).name}")
        elif not parts and self.exit_code:
            parts.append(f"exited with status {self.exit_code}")
        return "; ".join(parts)


class Sandbox:
    """Runs code under ``limits``; see the module docstring for the isolation. Thread-safe."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self._unshare = namespaces_available() if self.limits.namespaces != "off" else None
        self._uid = NOBODY if nobody_can_run() and "--user" not in (self._unshare or ()) else None
        if self.limits.namespaces == "required" and self._unshare is None:
            raise SandboxUnavailable(
                "namespaces: required, but unprivileged user namespaces do not work on this host "
                f"({namespace_probe_failure()}); allow them (kernel.unprivileged_userns_clone=1, or a "
                "container runtime that permits unshare), or set namespaces: auto to run without them"
            )
        self._seccomp = seccomp_available()

    @property
    def isolation(self) -> tuple[str, ...]:
        """The layers in use: ``namespaces``, ``nobody``, ``seccomp`` (each where it applies) and
        ``imports`` (always)."""
        layers = [("namespaces", self._unshare is not None), ("nobody", self._uid is not None),
                  ("seccomp", self._seccomp), ("imports", True)]  # fmt: skip
        return tuple(name for name, used in layers if used)

    def run(self, code: str, *, deadline: float | None = None) -> SandboxResult:
        """Run ``code`` (Python source) to its end or its first limit; ``deadline`` (UNIX seconds)
        shortens the wall-clock limit."""
        wall = self.limits.wall_s if deadline is None else min(self.limits.wall_s, deadline - time.time())
        if wall <= 0:
            return SandboxResult("", None, self.limits, timed_out="wall")
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="rlfleet-sandbox-", ignore_cleanup_errors=True) as workdir:
            path = os.path.join(workdir, "main.py")
            Path(path).write_text(code, encoding="utf-8")  # read before the code runs as nobody
            if self._uid is not None:
                os.chown(workdir, self._uid, self._uid)
            status_read, status_write = os.pipe()
            try:
                try:
                    proc = subprocess.Popen(
                        self._command(path, status_write), cwd=workdir, env={}, stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                        pass_fds=(status_write,),
                    )  # fmt: skip
                finally:
                    os.close(status_write)
                with proc:
                    kept, total, killed = _collect(proc, start + wall, self.limits.output_bytes)
                report = _read_report(status_read)
            finally:
                os.close(status_read)
        exit_code = report.get("exit")
        cpu = float(report.get("cpu_s", 0.0))
        over_cpu = exit_code in (sandbox_child.EXIT_CPU, -signal.SIGXCPU) or (
            exit_code == -signal.SIGKILL and cpu >= self.limits.cpu_s
        )
        return SandboxResult(
            output=kept.decode("utf-8", errors="replace"),
            exit_code=exit_code if isinstance(exit_code, int) else None,
            limits=self.limits,
            timed_out="wall" if killed else ("cpu" if over_cpu else ""),
            memory_exceeded=exit_code == sandbox_child.EXIT_MEMORY,
            network_refused=exit_code == sandbox_child.EXIT_NETWORK,
            output_bytes=total,
            seconds=time.monotonic() - start,
            cpu_s=cpu,
        )

    def _command(self, code_path: str, status_fd: int) -> list[str]:
        settings = {
            "cpu_s": self.limits.cpu_s,
            "memory_bytes": self.limits.memory_mb << 20,
            "file_bytes": self.limits.file_bytes,
            "seccomp": self._seccomp,
            "uid": self._uid,
        }
        python = [
            sys.executable,
            *PYTHON_FLAGS,
            CHILD_SCRIPT,
            json.dumps(settings),
            code_path,
            str(status_fd),
        ]
        return [*self._unshare, *python] if self._unshare else python


def _collect(proc: subprocess.Popen[bytes], end: float, cap: int) -> tuple[bytes, int, bool]:
    """Read ``proc``'s output until it ends or the monotonic time ``end``: the first ``cap`` bytes,
    the total written, and whether it was killed at ``end`` (its whole process group, by its pid,
    before it is reaped, so that pid cannot belong to another process yet)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    kept, total = bytearray(), 0
    while True:
        left = end - time.monotonic()
        if left <= 0:
            _kill(proc)
            return bytes(kept), total, True
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        total += len(chunk)
        kept += chunk[: max(0, cap - len(kept))]
    try:
        proc.wait(timeout=max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:  # it closed its output but runs on
        _kill(proc)
        return bytes(kept), total, True
    return bytes(kept), total, False


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_report(fd: int) -> dict[str, object]:
    """The supervisor's one JSON line (empty when it was killed before writing it)."""
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    try:
        report = json.loads(data) if data else {}
    except ValueError:
        return {}
    return report if isinstance(report, dict) else {}


@functools.cache
def _namespace_probe() -> tuple[tuple[str, ...] | None, str]:
    """(the ``unshare`` command when network, mount and pid namespaces work here, else None; why not).

    A root worker whose code can run as nobody tries them without a user namespace first."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None, "no unshare command"
    why = ""
    for flags in (NAMESPACE_FLAGS, USER_NAMESPACE_FLAGS) if nobody_can_run() else (USER_NAMESPACE_FLAGS,):
        try:
            done = subprocess.run([unshare, *flags, sys.executable, *PYTHON_FLAGS, "-c", "pass"], env={},
                                  capture_output=True, timeout=PROBE_S)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"{unshare} failed: {exc}"
            continue
        if done.returncode == 0:
            return (unshare, *flags), ""
        why = done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
    return None, why


def namespaces_available() -> tuple[str, ...] | None:
    """The ``unshare`` command when the sandbox's namespaces work on this host (probed once), else None."""
    return _namespace_probe()[0]


def namespace_probe_failure() -> str:
    """Why the namespaces do not work here ('' when they do)."""
    return _namespace_probe()[1]


@functools.cache
def nobody_can_run() -> bool:
    """Whether this worker is root and uid 65534 can run its Python (the standard library it imports
    included); probed once."""
    if os.geteuid() != 0:
        return False
    try:
        done = subprocess.run([sys.executable, *PYTHON_FLAGS, "-c", "import json, math, ctypes"], env={},
                              user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True,
                              timeout=PROBE_S)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@functools.cache
def seccomp_available() -> bool:
    """Whether the sandbox's seccomp filter installs (and refuses a socket) here; probed once."""
    try:
        done = subprocess.run([sys.executable, *PYTHON_FLAGS, CHILD_SCRIPT, "--probe"], env={},
                              capture_output=True, timeout=PROBE_S)  # fmt: skip
        ok = bool(json.loads(done.stdout or b"{}").get("seccomp"))
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        logger.warning(
            "sandbox: the seccomp probe failed (%s): sockets are refused by blocked imports only", exc
        )
        return False
    if not ok:
        logger.warning("sandbox: no seccomp filter here (%s)", done.stdout.decode(errors="replace").strip())
    return ok
