"""A worker's Prometheus metrics and health check, served over HTTP (issue 13: a fleet you can watch).

Every :class:`~rlfleet.common.control.worker.Worker` keeps a :class:`WorkerMetrics` (its own
registry, so several workers in one process never mix) and, when its config sets
``metrics_port``, serves it on ``metrics_host`` (``tensor_plane.bind_host`` when empty):

- ``GET /metrics``: Prometheus text format. Per worker (labels ``tier``, ``worker``):
  ``rlfleet_requests_total{kind,outcome}`` (ok / error / refused), ``rlfleet_request_seconds``
  (a histogram by kind), ``rlfleet_requests_in_progress`` (the queue this worker holds now),
  ``rlfleet_busy_seconds_total`` (its rate is the busy share), ``rlfleet_weight_version``,
  ``rlfleet_tokens_total`` (tokens generated or scored; its rate is tokens/s),
  ``rlfleet_worker_start_time_seconds`` (a change means a restart; also counted by
  ``rlfleet_worker_incarnation_info``).
- ``GET /healthz``: ``200`` with a JSON body while the worker is up, connected and not draining;
  ``503`` (same body, saying which) otherwise. Anything else is ``404``.

The server answers GET only, never reads a request body, and runs on a daemon thread.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rlfleet.common.schema.worker import ServiceConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Health:
    """What ``/healthz`` says: ``ok`` decides the status code, ``state`` says why."""

    ok: bool
    state: str  # "serving", "starting", "draining", "disconnected", ...
    weight_version: int
    in_flight: int

    @classmethod
    def of(cls, draining: bool, set_up: bool, connected: bool, weight_version: int, in_flight: int) -> Health:
        """A worker's health: serving once set up, connected and not draining."""
        if draining:
            state = "draining"
        elif not set_up:
            state = "starting"
        elif not connected:
            state = "disconnected"
        else:
            state = "serving"
        return cls(state == "serving", state, weight_version, in_flight)


class WorkerMetrics:
    """The metrics of one worker, in a registry of its own."""

    def __init__(self, tier: str, worker_id: str, incarnation: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"tier": tier, "worker": worker_id}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        self._requests = Counter(
            "rlfleet_requests", "requests handled, by kind and outcome", [*names, "kind", "outcome"],
            registry=self.registry,
        )  # fmt: skip
        self._seconds = Histogram(
            "rlfleet_request_seconds", "time to handle a request, by kind", [*names, "kind"],
            buckets=(0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900), registry=self.registry,
        )  # fmt: skip
        self._labels = labels
        self.in_progress = gauge("rlfleet_requests_in_progress", "requests this worker is handling now")
        self.busy_seconds = Counter(
            "rlfleet_busy_seconds", "seconds with a request in progress", names, registry=self.registry
        ).labels(**labels)
        self.weight_version = gauge("rlfleet_weight_version", "weight version the worker serves (-1: none)")
        self.tokens = Counter(
            "rlfleet_tokens", "tokens generated (rollout) or scored (reward)", names, registry=self.registry
        ).labels(**labels)
        gauge("rlfleet_worker_start_time_seconds", "when this worker started (unix time)").set(time.time())
        Gauge(
            "rlfleet_worker_incarnation_info", "this process's incarnation id", [*names, "incarnation"],
            registry=self.registry,
        ).labels(**labels, incarnation=incarnation).set(1)  # fmt: skip
        self.weight_version.set(-1)
        self._busy_since: float | None = None
        self._running = 0
        self._lock = threading.Lock()

    @contextmanager
    def request(self, kind: str) -> Iterator[None]:
        """Count one request of ``kind``: in progress while the block runs, then by outcome and time."""
        start = time.monotonic()
        with self._lock:
            self._running += 1
            if self._running == 1:
                self._busy_since = start
        self.in_progress.inc()
        outcome = "error"
        try:
            yield
            outcome = "ok"
        finally:
            end = time.monotonic()
            self.in_progress.dec()
            with self._lock:
                self._running -= 1
                if self._running == 0 and self._busy_since is not None:
                    self.busy_seconds.inc(end - self._busy_since)
                    self._busy_since = None
            self._requests.labels(**self._labels, kind=kind, outcome=outcome).inc()
            self._seconds.labels(**self._labels, kind=kind).observe(end - start)

    def refused(self, kind: str) -> None:
        """A request turned away before it started (the worker was draining)."""
        self._requests.labels(**self._labels, kind=kind, outcome="refused").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """``/metrics`` and ``/healthz`` of one worker on ``host:port`` (port 0: any free one)."""

    def __init__(
        self,
        metrics: WorkerMetrics,
        health: Callable[[], Health],
        host: str,
        port: int,
        on_scrape: Callable[[], None] | None = None,
    ) -> None:
        self.metrics = metrics
        self.health = health
        self.on_scrape = on_scrape
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    if owner.on_scrape is not None:
                        owner.on_scrape()
                    self._send(200, owner.metrics.exposition(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    health = owner.health()
                    body = json.dumps(health.__dict__).encode()
                    self._send(200 if health.ok else 503, body, "application/json")
                else:
                    self._send(404, b"not found: /metrics and /healthz only\n", "text/plain")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
                logger.debug("metrics http: " + format, *args)

        return Handler


def serve_metrics(
    metrics: WorkerMetrics, health: Callable[[], Health], config: ServiceConfig, name: str,
    on_scrape: Callable[[], None] | None = None,
) -> MetricsServer | None:  # fmt: skip
    """Start ``name``'s metrics server on ``config.metrics_port`` (None: no server) and
    ``config.metrics_host`` (empty: the TensorStore's ``tensor_plane.bind_host``)."""
    if config.metrics_port is None:
        return None
    host = config.metrics_host or config.tensor_plane.bind_host
    server = MetricsServer(metrics, health, host, config.metrics_port, on_scrape=on_scrape).start()
    logger.info("%s metrics on http://%s:%d/metrics (health: /healthz)", name, host, server.port)
    return server
