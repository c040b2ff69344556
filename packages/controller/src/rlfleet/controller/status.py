"""``rlfleet status``: the workers of a running fleet as a table (issue 13: a fleet you can watch).

::

    rlfleet status --nats nats://host:4222 --cluster prod [--watch] [--nats-user ...]
    rlfleet status --run outputs/tiny_grpo [--watch]      # a run this machine launched

It joins the fleet's membership subjects as an observer (the same registry the controller keeps),
asks every worker to announce itself, and after ``--wait`` seconds prints the trainer's current
step and weight version, then one row per worker: tier, id, pool, host (its hostname, and its
TensorStore host after a slash when that differs), pid, weight version, requests in progress, health
(``ok`` while heartbeats arrive, ``silent Ns`` once they stop), its release (the version of its
package, ``rlfleet-<tier>``; ``-`` for a worker older than wire 2.4), the wire protocol version it
speaks, and what it is doing. With
``--watch`` the table is redrawn every ``--interval`` seconds until Ctrl-C. Credentials come from
the ``--nats-*`` flags or ``RLFLEET_NATS_*`` (on a permissioned server, a user that may subscribe
to the membership subjects and publish the controller's ping, such as the controller's); with
``--run`` from the observer login the run's launcher wrote (``fleet/status.yaml``, this user only:
the ``observer`` role may read membership and ping, nothing else). ``--run`` on a run whose
controller is gone says so instead of trying its server: ``the run has ended`` with its last step
(:func:`ended_line`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from rlfleet.common.control.membership import WorkerInfo, WorkerRegistry
from rlfleet.common.control.transport import WORKER_TIERS
from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.controller.watchdog import SILENT_AFTER_S  # unheard this long: "silent", as the watchdog says

COLUMNS = ("TIER", "WORKER", "POOL", "HOST", "PID", "VERSION", "BUSY", "HEALTH", "RELEASE", "WIRE",
           "ACTIVITY")  # fmt: skip


def add_status_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from rlfleet.common.control.worker import add_nats_arguments

    status = sub.add_parser("status", help="print the workers of a running fleet")
    status.add_argument("--run", type=Path, default=None,
                        help="a running embedded or Ray-launched run's output_dir (its fleet/status.yaml "
                        "holds the URL, cluster and an observer's login)")  # fmt: skip
    status.add_argument("--nats", dest="nats_url", default=None, help="NATS URL of the fleet")
    status.add_argument("--cluster", default=None, help="the fleet's cluster name (a run's `cluster`)")
    status.add_argument("--watch", action="store_true", help="redraw the table until Ctrl-C")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (--watch)")
    status.add_argument("--wait", type=float, default=2.5, help="seconds to listen before the first table")
    add_nats_arguments(status)


def host_of(worker: WorkerInfo) -> str:
    """Where a worker runs: its hostname (wire 2.3 announces carry it), and the host of its
    TensorStore address (``host:port``, ``[v6]:port``) when it has one; ``-`` when neither is known."""
    address = worker.data_address
    store = address.rpartition(":")[0].strip("[]") if address else ""
    name = worker.announce.host
    if name and store and store != name:
        return f"{name}/{store}"
    return name or store or "-"


def release_of(worker: WorkerInfo) -> str:
    """A worker's release: its package's version (``name==version`` for a package other than its
    tier's own), ``-`` when its announce does not say (wire 2.3 and older)."""
    package, version = worker.announce.package, worker.announce.package_version
    if not version:
        return "-"
    return version if package in ("", f"rlfleet-{worker.tier}") else f"{package}=={version}"


def rows(workers: Sequence[WorkerInfo], now: float) -> list[tuple[str, ...]]:
    """One row per worker (tiers in fleet order, then by id)."""
    out = []
    order = {tier: i for i, tier in enumerate(WORKER_TIERS)}
    for w in sorted(workers, key=lambda w: (order.get(w.tier, 99), w.worker_id)):
        heard = now - w.last_seen
        health = "ok" if heard <= SILENT_AFTER_S else f"silent {heard:.0f}s"
        activity = f"{w.activity} ({w.activity_s + heard:.0f}s)" if w.activity else "idle"
        version = str(w.weight_version) if w.weight_version >= 0 else "-"
        pid = str(w.announce.pid) if w.announce.pid else "-"
        out.append((w.tier, w.worker_id, w.pool, host_of(w), pid, version, str(w.busy), health,
                    release_of(w), w.announce.protocol, activity))  # fmt: skip
    return out


def render(cluster: str, workers: Sequence[WorkerInfo], now: float) -> str:
    """The table, under a summary line (workers per tier, the trainer's weight version)."""
    counts = ", ".join(f"{tier} {sum(w.tier == tier for w in workers)}" for tier in WORKER_TIERS)
    trainers = [w for w in workers if w.tier == "trainer"]
    steps = [w.step for w in trainers if w.step >= 0]
    versions = [w.weight_version for w in trainers if w.weight_version >= 0]
    version = f"; trainer at step {max(steps)}" if steps else ("; trainer" if versions else "")
    version += f"{',' if steps else ' at'} weight version {max(versions)}" if versions else ""
    lines = [f"fleet {cluster}: {counts}{version}"]
    table = [COLUMNS, *rows(workers, now)]
    if len(table) == 1:
        return lines[0] + "\n(no worker answered: is the cluster name right, and is the fleet running?)\n"
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    for row in table:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"


async def snapshot(registry: WorkerRegistry) -> list[WorkerInfo]:
    return [w for tier in WORKER_TIERS for w in registry.workers(tier)]


async def show(args: argparse.Namespace, out=sys.stdout) -> None:  # noqa: ANN001 - a text stream
    from rlfleet.common.control.nats_transport import NatsTransport
    from rlfleet.common.control.worker import connection_from_args

    auth = connection_from_args(args)
    if args.run is not None:
        ended = ended_line(args.run)
        if ended is not None:
            out.write(ended + "\n")
            return
        args.nats_url, args.cluster, auth = _run_login(args.run)
    if not args.nats_url or not args.cluster:
        raise ConfigError("status", "", "give --run OUTPUT_DIR, or --nats URL and --cluster NAME")
    transport = await NatsTransport.connect(
        args.nats_url, name="rlfleet-status", tier="controller", auth=auth,
        max_reconnect_attempts=0 if not args.watch else -1,
    )  # fmt: skip
    # observe, never reap; the observer login may not ask workers to confirm a leave (membership.py)
    registry = WorkerRegistry(transport, args.cluster, dead_after=3600.0, verify=False)
    try:
        await registry.start()
        await asyncio.sleep(max(0.0, args.wait))
        while True:
            text = render(args.cluster, await snapshot(registry), time.monotonic())
            out.write(("\x1b[2J\x1b[H" if args.watch and out.isatty() else "") + text)
            out.flush()
            if not args.watch:
                return
            await asyncio.sleep(max(0.2, args.interval))
    finally:
        await registry.stop()
        await transport.close()


def ended_line(run_dir: Path) -> str | None:
    """``run outputs/x: the run has ended at step 36 of 36 (final model in outputs/x/final)`` when the
    controller that ran ``run_dir`` is gone (its pid in ``fleet/processes.json`` runs no more), else
    None (it may still run; a run of another launcher has no such file)."""
    try:
        pid = json.loads((run_dir / "fleet" / "processes.json").read_text()).get("controller_pid")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(pid, int) or _alive(pid):
        return None
    step, total = _last_step(run_dir)
    at = f" at step {step}" if step is not None else " before its first step"
    at += f" of {total}" if total is not None and step is not None else ""
    final = run_dir / "final"
    how = f"final model in {final}" if final.is_dir() else "it stopped before its end: no final model"
    return f"run {run_dir}: the run has ended{at} ({how})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _last_step(run_dir: Path) -> tuple[int | None, int | None]:
    """The last step in ``metrics.jsonl`` and the run's planned total (``config.yaml``'s max_steps)."""
    step = total = None
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        step = json.loads(lines[-1]).get("step") if lines else None
    except (OSError, ValueError, AttributeError):
        pass
    try:
        total = yaml.safe_load((run_dir / "config.yaml").read_text()).get("max_steps")
    except (OSError, yaml.YAMLError, AttributeError):
        pass
    return (step if isinstance(step, int) else None), (total if isinstance(total, int) else None)


def _run_login(run_dir: Path) -> tuple[str, str, NatsConnection]:
    """The URL, cluster and observer login a run wrote to ``fleet/status.yaml``."""
    path = run_dir / "fleet" / "status.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError("--run", str(run_dir), f"no {path}: is it the output_dir of a run started by its "
                          "launcher (not one that joined a fleet by nats_url)?") from None  # fmt: skip
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError("--run", str(path), f"unreadable: {exc}") from None
    if not isinstance(data, dict) or not {"nats_url", "cluster", "nats_auth"} <= set(data):
        raise ConfigError("--run", str(path), "not a run's status file (nats_url, cluster, nats_auth)")
    return str(data["nats_url"]), str(data["cluster"]), NatsConnection.model_validate(data["nats_auth"])


def run_status_command(args: argparse.Namespace) -> int:
    """``rlfleet status``: 0 when the table was printed, 1 when the fleet could not be reached."""
    import logging

    from rlfleet.common.errors import RlfleetError

    logging.getLogger("rlfleet.common").setLevel(logging.ERROR)  # reconnect chatter: the error says it
    try:
        asyncio.run(show(args))
    except KeyboardInterrupt:
        return 0
    except RlfleetError as exc:
        print(f"rlfleet status: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0
