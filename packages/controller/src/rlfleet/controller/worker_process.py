"""One worker process of an embedded run: what to start (:class:`WorkerSpec`), the started process
(:class:`WorkerProcess`: its pid, log, and the error its exit reads as), and the helpers around
them (the console script to run, the line of a crashed worker's log that says why, killing what a
worker's process group left behind). :mod:`rlfleet.controller.launcher` starts, watches and stops
them; the Ray launcher reuses the spec and the log reading.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rlfleet.common.control.worker import USER_ERROR_EXIT
from rlfleet.controller.errors import TierDied, TierRefused

logger = logging.getLogger(__name__)

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

        Only the settings that differ from their defaults are written, so a worker of an older
        release, which refuses settings it does not know, still reads a newer controller's file
        while the newer settings keep their defaults (tests/compat)."""
        config = (
            self.config.model_dump(mode="json", exclude_defaults=True)
            if isinstance(self.config, BaseModel)
            else dict(self.config)
        )
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
        error = "" if code < 0 else last_error_line(tail)
        kind = TierRefused if code == USER_ERROR_EXIT else TierDied  # exit 2: the worker refused its settings
        return kind(
            self.spec.tier, self.spec.worker_id, code, error=error, log_path=self.log_path, log_tail=tail
        )

    def kill_group(self) -> None:
        """SIGKILL what is left of the worker's process group (it leads one)."""
        kill_group(self.pid)

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
