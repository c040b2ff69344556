"""What every tier's worker process shares: connect, announce, heartbeat, serve, leave.

A tier subclasses :class:`Worker`, subscribes its handlers in :meth:`Worker.setup`, and its
console script's ``main()`` calls :func:`run_worker_main`. Workers announce on the cluster's
membership subject, send heartbeats, answer :class:`Ping` with a fresh announce, stop on
:class:`Shutdown`, SIGTERM or SIGINT, and say :class:`WorkerLeave` on the way out.

Work subscriptions (:meth:`Worker.subscribe`) and the worker's own subject run their requests
inside :meth:`InFlight.track` (its kind and job id, and when it began; the last section):
heartbeats carry the oldest one as the worker's activity (``"score job step3-0 (+1 more)"``, for
how long), so a controller that waits for a reply can tell "busy on my job for 75 s" from "idle"
and from "not heard" (the watchdog names it). Stopping drains: the worker refuses
requests that have not started yet with :class:`~rlfleet.common.errors.WorkerDraining`
(retryable: the requester sends it to another replica), leaves its queue groups (the server sends
it nothing new; what it sent already is still answered), lets what it took finish for up to
``drain_s`` seconds, and only then says goodbye and releases its resources. A request still
running at the bound is cancelled.

The worker's own subject is its identity (issue 29): only this process listens there, so the
controller's registry checks a membership change about a worker with it (a :class:`Ping` there is
answered with the worker's :class:`WorkerAnnounce`, its own account of itself), and believes a
leave only once nobody answers there. So a stopping worker leaves its own subject after the drain
and before it says goodbye (:meth:`Worker.stop`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

from rlfleet.common.control.membership import Heartbeater, WorkerStatus, release_of
from rlfleet.common.control.messages import (
    PROTOCOL,
    Ack,
    AnyMessage,
    Ping,
    Shutdown,
    WorkerAnnounce,
)
from rlfleet.common.control.transport import Handler, Subscription, Transport, worker_subject
from rlfleet.common.control.worker_metrics import Health, MetricsServer, WorkerMetrics, serve_metrics
from rlfleet.common.errors import WorkerDraining, WrongMessageKind
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.common.schema.worker import ServiceConfig

logger = logging.getLogger(__name__)

USER_ERROR_EXIT = 2
"""A worker's exit status when its settings cannot work (the launcher reports it as the user's to fix)."""


C = TypeVar("C", bound=ServiceConfig)


class Worker(Generic[C]):
    """Base of a tier's worker: lifecycle and membership; subclasses add handlers in ``setup``."""

    tier: ClassVar[str] = ""

    def __init__(self, config: C, transport: Transport) -> None:
        self.config = config
        self.transport = transport
        self.worker_id = config.worker_id or f"{self.tier}-{socket.gethostname()}-{os.getpid()}"
        self.weight_version = -1
        self.trained_step = -1  # the last training step done (a trainer sets it; heartbeats carry it)
        self.busy = 0
        self.incarnation = uuid.uuid4().hex[:16]
        """This process's life: announces (and replies that say so) carry it; a restart makes another."""
        self.in_flight = InFlight()
        """The requests this worker is handling (work subscriptions and its own subject)."""
        self.draining = False
        """Set when the worker starts to stop: requests that arrive from then on are refused."""
        self._work_subs: list[Subscription] = []
        self._own_sub: Subscription | None = None
        self._stopped = asyncio.Event()
        self._membership: Heartbeater | None = None
        self._set_up = False
        self.metrics = WorkerMetrics(self.tier, self.worker_id, self.incarnation)
        """Prometheus metrics (requests, busy time, weight version, tokens); served if metrics_port is set."""
        self.metrics_server: MetricsServer | None = None

    # --- to override ----------------------------------------------------------------------

    async def setup(self) -> None:
        """Start resources and subscribe handlers; called before the first announce.

        If it raises, :meth:`teardown` is not called (the process is about to exit with the error).
        """

    async def teardown(self) -> None:
        """Release resources; called after the leave message, only if :meth:`setup` completed."""

    def announce_fields(self) -> dict[str, object]:
        """Extra WorkerAnnounce fields (data_address, capacity, model_id...)."""
        return {}

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def own_subject(self) -> str:
        return worker_subject(self.config.fleet.cluster, self.tier, self.worker_id)

    def announcement(self) -> WorkerAnnounce:
        return WorkerAnnounce(
            tier=self.tier,  # type: ignore[arg-type]
            worker_id=self.worker_id,
            subject=self.own_subject,
            weight_version=self.weight_version,
            pool=self.config.pool,
            pid=os.getpid(),
            host=socket.gethostname()[:255],
            incarnation=self.incarnation,
            **release_of(self.tier),
            **self.announce_fields(),  # type: ignore[arg-type]
        )

    async def start(self) -> None:
        self._start_metrics()
        await self.setup()
        self._set_up = True
        self._own_sub = await self.transport.subscribe(self.own_subject, self._on_own)
        self._membership = Heartbeater(
            self.transport, self.config.fleet.cluster, self.announcement, interval=self.config.heartbeat_s,
            status=self.status,
        )  # fmt: skip
        await self._membership.start()
        release = " ".join(release_of(self.tier).values())
        logger.info("%s worker %s is up on cluster %s (%s, wire %s)", self.tier, self.worker_id,
                    self.config.fleet.cluster, release, PROTOCOL)  # fmt: skip

    def _start_metrics(self) -> None:
        if self.metrics_server is None:
            self.metrics_server = serve_metrics(self.metrics, self.health, self.config, self.worker_id,
                                                on_scrape=self._sample)  # fmt: skip

    def _sample(self) -> None:
        self.metrics.weight_version.set(self.weight_version)

    def health(self) -> Health:
        """What ``/healthz`` answers: serving once set up, connected and not draining."""
        connected = bool(getattr(self.transport, "is_connected", True))
        return Health.of(self.draining, self._set_up, connected, self.weight_version, len(self.in_flight))

    def status(self) -> WorkerStatus:
        """What the next heartbeat reports: weight version, busy count, the oldest request in progress."""
        activity, seconds = self.in_flight.describe()
        if self.draining:
            activity = f"draining ({len(self.in_flight)} in flight{': ' + activity if activity else ''})"
        return WorkerStatus(self.weight_version, self.busy, activity, seconds, self.trained_step)

    async def subscribe(
        self, subject: str, handler: Handler, *, queue: str | None = None, max_concurrency: int | None = None
    ) -> Subscription:
        """Subscribe ``handler`` as this worker's work (see :meth:`Transport.subscribe`): each request is
        tracked in :attr:`in_flight`, refused with :class:`WorkerDraining` once the worker is stopping,
        and the subscription is drained when it stops."""
        sub = await self.transport.subscribe(
            subject, self._tracked(handler), queue=queue, max_concurrency=max_concurrency
        )
        self._work_subs.append(sub)
        return sub

    def _tracked(self, handler: Handler) -> Handler:
        async def run(message: AnyMessage) -> AnyMessage | None:
            if self.draining:
                self.metrics.refused(message.kind)
                raise WorkerDraining(self.tier, self.worker_id, message.kind)
            with (
                self.in_flight.track(message.kind, str(getattr(message, "job_id", "") or "")),
                self.metrics.request(message.kind),
            ):
                return await handler(message)

        return run

    async def _on_own(self, message: AnyMessage) -> AnyMessage | None:
        if isinstance(message, Shutdown):
            logger.info("shutdown asked: %s", message.reason or "no reason given")
            self._stopped.set()
            return Ack(detail=f"{self.worker_id} stopping")
        if isinstance(message, Ping):  # the registry checks who is here (module docstring)
            return self.announcement()
        return await self._tracked(self.handle_own)(message)

    async def handle_own(self, message: AnyMessage) -> AnyMessage | None:
        """Messages addressed to this worker alone (besides Shutdown)."""
        raise WrongMessageKind(f"{self.tier} worker {self.worker_id}", message.kind)

    def request_stop(self) -> None:
        self._stopped.set()

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def drain(self) -> None:
        """Stop taking requests and let those in progress finish, for up to ``drain_s`` seconds."""
        if self.draining:
            return
        self.draining = True
        bound = self.config.drain_s
        start = time.monotonic()
        subs, self._work_subs = self._work_subs, []
        busy = len(self.in_flight)
        if busy:
            logger.info("%s draining: %d request(s) in progress (%s), waiting up to %.0f s",
                        self.worker_id, len(self.in_flight), self.in_flight.describe()[0], bound)  # fmt: skip
        ended = await asyncio.gather(
            *(s.unsubscribe(drain_timeout=bound) for s in subs), return_exceptions=True
        )
        for sub, outcome in zip(subs, ended, strict=True):
            if isinstance(outcome, BaseException):
                logger.warning("%s: leaving %s failed: %r", self.worker_id, sub.subject, outcome)
        left = bound - (time.monotonic() - start)
        if not await self.in_flight.wait_idle(left):  # requests on the worker's own subject
            running = self.in_flight.describe()[0]
            logger.warning("%s: drain bound of %.0f s passed, %d request(s) still running (%s)",
                           self.worker_id, bound, len(self.in_flight), running)  # fmt: skip
        elif busy:
            logger.info("%s drained in %.1f s", self.worker_id, time.monotonic() - start)

    async def stop(self, reason: str = "") -> None:
        self._stopped.set()
        if self._set_up:
            await self.drain()
        own, self._own_sub = self._own_sub, None
        if own is not None:  # before the leave: the registry believes it once nobody answers here
            try:
                await own.unsubscribe(drain_timeout=1.0)
            except (ConnectionError, TimeoutError) as exc:
                logger.warning("%s: leaving its own subject failed: %r", self.worker_id, exc)
        if self._membership is not None:
            await self._membership.stop(reason)  # heartbeats end, WorkerLeave goes out
            self._membership = None
        if self._set_up:  # a failed setup must not be masked by a teardown of half-made resources
            self._set_up = False
            await self.teardown()
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None


# --- entry points ---------------------------------------------------------------------------


def configure_logging(level: str, as_json: bool, name: str) -> None:
    """Set up the root logger; only ever called from a ``main()``."""
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(_JsonFormatter(name))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "service": self.service,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def parse_service_args(prog: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """``PROG serve [--config FILE] [--nats URL] [--nats-*] [--cluster NAME] [--worker-id ID] [k=v ...]``
    (overrides name a setting by its place, ``placement.device=cpu``, or by its flat name, ``device=cpu``)."""
    parser = argparse.ArgumentParser(prog=prog, description=f"run a {prog} worker")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start a worker and join a cluster")
    serve.add_argument("--config", type=Path, default=None, help="YAML or TOML worker config")
    serve.add_argument("--nats", dest="nats_url", default=None, help="NATS URL (overrides the config)")
    serve.add_argument("--cluster", default=None, help="cluster name (overrides the config)")
    serve.add_argument("--worker-id", default=None, help="worker id (overrides the config)")
    serve.add_argument("--pool", default=None, help="pool name (overrides the config)")
    add_nats_arguments(serve)
    serve.add_argument("overrides", nargs="*", help="config overrides a.b.c=value")
    return parser.parse_args(argv)


NATS_FLAGS = {
    "nats_user": ("user", "NATS user (its password: nats_auth.password or $RLFLEET_NATS_PASSWORD)"),
    "nats_creds": ("creds_file", "NATS .creds file"),
    "nats_nkey": ("nkey_seed_file", "file holding a NATS NKey seed"),
    "nats_ca": ("tls_ca_file", "CA file that signs the NATS server's certificate (TLS)"),
    "nats_cert": ("tls_cert_file", "client certificate for mutual TLS"),
    "nats_key": ("tls_key_file", "client key for mutual TLS"),
}
"""``--nats-*`` flags: ``dest -> (NatsConnection field, help)``. Passwords and tokens have none (argv
is visible in ``ps``): they come from the config file or the environment."""


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--nats-user``, ``--nats-creds``, ``--nats-nkey``, ``--nats-ca``, ``--nats-cert``,
    ``--nats-key`` and ``--nats-tls`` options of every command that connects to NATS."""
    for dest, (_, text) in NATS_FLAGS.items():
        parser.add_argument("--" + dest.replace("_", "-"), dest=dest, default=None, help=text)
    parser.add_argument("--nats-tls", dest="nats_tls", action="store_true", default=None,
                        help="connect to NATS over TLS (implied by --nats-ca / --nats-cert)")  # fmt: skip


def nats_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--nats-*`` flags as ``fleet.nats_auth.<field>=value`` overrides."""
    out = [f"fleet.nats_auth.{field}={getattr(args, dest)}" for dest, (field, _) in NATS_FLAGS.items()
           if getattr(args, dest, None) is not None]  # fmt: skip
    if getattr(args, "nats_tls", None):
        out.append("fleet.nats_auth.tls=true")
    return out


def connection_from_args(args: argparse.Namespace) -> NatsConnection:
    """A :class:`NatsConnection` from the ``--nats-*`` flags of a command without a config file
    (the reward admin CLI); the rest from ``RLFLEET_NATS_*`` when it connects."""
    from rlfleet.common.schema.config import apply_overrides

    data = apply_overrides({}, nats_overrides(args)).get("fleet", {}).get("nats_auth", {})
    return NatsConnection.model_validate(data)


def cli_overrides(args: argparse.Namespace) -> list[str]:
    """Turn the common flags into ``key=value`` overrides of the worker config's sections, after the
    free-form ones."""
    extra = [
        f"{key}={value}"
        for key, value in (
            ("fleet.nats_url", args.nats_url),
            ("fleet.cluster", args.cluster),
            ("worker_id", args.worker_id),
            ("pool", args.pool),
        )
        if value is not None
    ]
    return [*args.overrides, *extra, *nats_overrides(args)]


async def serve(worker: Worker[C]) -> None:
    """Run ``worker`` until Shutdown, SIGTERM or SIGINT, then leave cleanly."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    try:
        await worker.start()
        await worker.serve_forever()
    finally:
        await worker.stop("shutdown")


def run_worker_main(
    prog: str,
    config_cls: type[C],
    make_worker: Callable[[C, Transport], Worker[C]],
    argv: Sequence[str] | None = None,
) -> int:
    """The whole ``main()`` of a tier's console script."""
    from rlfleet.common.control.nats_transport import NatsTransport
    from rlfleet.common.errors import ConfigError, UserError
    from rlfleet.common.schema.config import load_config

    args = parse_service_args(prog, argv)
    try:
        config = load_config(config_cls, args.config, cli_overrides(args))
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT
    configure_logging(config.log_level, config.log_json, prog)

    async def _main() -> None:
        transport = await NatsTransport.connect(
            config.fleet.nats_url, name=prog, tier=prog.removeprefix("rlfleet-"), auth=config.fleet.nats_auth
        )
        try:
            await serve(make_worker(config, transport))
        finally:
            await transport.close()

    try:
        asyncio.run(_main())
    except UserError as exc:  # the worker's settings cannot work (a bad spec, a missing model...)
        logger.error("%s refused to serve", prog)
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)  # the line the launcher reports
        return USER_ERROR_EXIT
    return 0


# --- what the worker is handling now (heartbeats report it, the drain waits on it) -------------------


@dataclass(frozen=True)
class Job:
    """One request in progress."""

    kind: str
    job_id: str
    since: float

    def label(self) -> str:
        """``"score job step3-0"``, or just the kind when the request has no job id."""
        return f"{self.kind} job {self.job_id}" if self.job_id else self.kind


class InFlight:
    """The requests a worker is handling, each with its kind, job id and start time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._idle: asyncio.Event | None = None

    def __len__(self) -> int:
        return len(self._jobs)

    def jobs(self) -> list[Job]:
        """The requests in progress, oldest first."""
        return sorted(self._jobs.values(), key=lambda job: job.since)

    @contextmanager
    def track(self, kind: str, job_id: str = "") -> Iterator[Job]:
        """Count a request as in progress for the time of the ``with`` block."""
        key = next(self._ids)
        job = Job(kind, job_id, self._clock())
        self._jobs[key] = job
        if self._idle is not None:
            self._idle.clear()
        try:
            yield job
        finally:
            del self._jobs[key]
            if not self._jobs and self._idle is not None:
                self._idle.set()

    def describe(self) -> tuple[str, float]:
        """``(activity, seconds)`` of the oldest request in progress; ``("", 0.0)`` when idle."""
        jobs = self.jobs()
        if not jobs:
            return "", 0.0
        more = f" (+{len(jobs) - 1} more)" if len(jobs) > 1 else ""
        return jobs[0].label() + more, max(0.0, self._clock() - jobs[0].since)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every request in progress to end; True if none is left."""
        if not self._jobs:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout))
        except TimeoutError:
            return not self._jobs
        return True
