"""What security costs: the tensor plane and a tiny run's step with TLS and auth on and off, in one run.

    uv run --extra cpu python benchmarks/security_overhead.py           # 256 MiB, tiny_grpo steps
    uv run --extra cpu python benchmarks/security_overhead.py --mb 64 --reps 3 --steps 6 --skip-step
    uv run --extra cpu python benchmarks/security_overhead.py --smoke   # 32 MiB, 1 round, 1 step (CI)

Tensor plane: a producer process serves the same tensors from three TensorStores. ``plain``: no
TLS and no checks (the benchmark swaps the store's guard for one that lets every call through:
the store as it was before it was guarded; nothing outside this script can do that). ``guarded``:
the real store, read with the capability of its ref and written with its bearer secret, as the
tiers do. ``guarded_tls``: the same, over TLS with a self-signed certificate the benchmark makes.
This process gets (``fetch``) and puts ``--mb`` MiB on each and times ``--small`` gets of a 1 KiB
key (the per-RPC cost that the secret and capability checks add, and the TLS record overhead).

Step: ``--job`` (default the tiny GRPO job) runs three times at once, as ``rlfleet train`` runs
it, differing only in the embedded nats-server's security (``RLFLEET_BENCHMARK_NATS``, read only
by the launcher: see ``rlfleet.controller.launcher.NatsSecurity``). ``open``: no credentials, no
permissions. ``roles``: the default, a password and subject permissions per role. ``roles_tls``:
the default plus TLS. The stores stay guarded in all three (a run cannot turn that off; the
tensor part measures it). The three runs step in turn, in a rotating order, so load from other
processes hits them alike; medians after ``--warmup`` steps each.

Tensor rounds interleave the variants the same way, after one warm-up round. Both parts record
the 1-minute load average. Results: benchmarks/results/security_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import smoke
import torch
from step_overhead import PHASES, build
from tensor_stream import CPU, _timed, crcs, make_payload, payload_bytes, with_producer

from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors.guard import StoreGuard
from rlfleet.common.tensors.store import TensorStoreClient, TensorStoreServer
from rlfleet.controller.launcher import BENCHMARK_NATS_ENV

RESULTS = Path(__file__).parent / "results" / "security_overhead.json"
STORES = ("plain", "guarded", "guarded_tls")
NATS_MODES = ("open", "roles", "roles_tls")


def self_signed(folder: Path) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1 and its key, as PEM files (its own CA)."""
    cert, key = folder / "bench.pem", folder / "bench.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=rlfleet-benchmark", "-keyout", str(key),
                    "-out", str(cert), "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)  # fmt: skip
    return str(cert), str(key)


# --- tensor plane ------------------------------------------------------------------------------


class _Unguarded(StoreGuard):
    """Benchmark-only: lets every call through (the store before it was guarded), the baseline."""

    def is_owner(self, metadata: Any) -> bool:
        return True

    def may_open(self, key: str, metadata: Any) -> bool:
        return True


def producer(mb: int, cert: str, key: str, conn: Connection) -> None:
    asyncio.run(_produce(mb, cert, key, conn))


async def _produce(mb: int, cert: str, key: str, conn: Connection) -> None:
    tensors, small = make_payload(mb), {"x": torch.arange(256, dtype=torch.int32)}
    servers = {
        "plain": TensorStoreServer(capacity_bytes=8 << 30, ttl_s=3600.0),
        "guarded": TensorStoreServer(capacity_bytes=8 << 30, ttl_s=3600.0),
        "guarded_tls": TensorStoreServer(capacity_bytes=8 << 30, ttl_s=3600.0, tls_cert=cert, tls_key=key),
    }
    servers["plain"].guard = _Unguarded()
    info: dict[str, Any] = {"pid": os.getpid(), "crcs": crcs(tensors), "nbytes": payload_bytes(tensors)}
    for name, server in servers.items():
        await server.start()
        info[name] = {"secret": server.secret, "payload": server.put_local("payload", tensors).model_dump(),
                      "small": server.put_local("small", small).model_dump()}  # fmt: skip
    conn.send(info)
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # the consumer says when it is done
    for server in servers.values():
        await server.stop()


async def _small_gets(reader: TensorStoreClient, ref: TensorRef, count: int) -> float:
    """Median milliseconds of one get of a 1 KiB key."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        await reader.fetch(ref)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


async def tensor_rounds(
    info: dict[str, Any], args: argparse.Namespace, ca: str
) -> dict[str, dict[str, list]]:
    """Per store: get and put MB/s and small-get ms of each timed round."""
    upload, peer, nbytes = make_payload(args.mb, seed=1), info["pid"], info["nbytes"]
    owners, readers, refs = {}, {}, {}
    for name in STORES:
        tls = ca if name == "guarded_tls" else ""
        address = TensorRef.model_validate(info[name]["payload"]).address
        secret = info[name]["secret"] if name != "plain" else None
        owners[name] = TensorStoreClient(address, secret=secret, tls_ca=tls)  # puts and deletes
        readers[name] = TensorStoreClient(address, tls_ca=tls)  # reads by the ref's capability alone
        refs[name] = {k: TensorRef.model_validate(info[name][k]) for k in ("payload", "small")}
        if name == "plain":
            refs[name] = {k: r.model_copy(update={"capability": ""}) for k, r in refs[name].items()}
        if crcs(await readers[name].fetch(refs[name]["payload"])) != info["crcs"]:
            raise AssertionError(f"payload damaged in transit from the {name} store")
    rounds: dict[str, dict[str, list]] = {name: {"get": [], "put": [], "small_get_ms": []} for name in STORES}
    for rep in range(args.reps + 1):
        order = STORES[rep % 3 :] + STORES[: rep % 3]
        line = []
        for name in order:
            reader, owner = readers[name], owners[name]
            get = await _timed(f"{name}_get", lambda: reader.fetch(refs[name]["payload"]), nbytes, peer)  # noqa: B023
            stored: list[TensorRef] = []
            put = await _timed(f"{name}_put", lambda: _put(owner, upload, stored), nbytes, peer)  # noqa: B023
            await owner.delete(stored[0])
            small = await _small_gets(reader, refs[name]["small"], args.small)
            if rep > 0:  # round 0 warms up
                for field, value in (("get", get), ("put", put), ("small_get_ms", small)):
                    rounds[name][field].append(value)
            line.append(f"{name} get {get:5.0f} put {put:5.0f} MB/s small {small:5.2f} ms")
        print(f"tensor round {rep}{' (warm-up)' if rep == 0 else ''}: " + " | ".join(line), flush=True)
    for client in (*owners.values(), *readers.values()):
        await client.close()
    return rounds


async def _put(owner: TensorStoreClient, upload: dict[str, torch.Tensor], stored: list[TensorRef]) -> None:
    stored.append(await owner.put("upload", upload))


def tensor_part(args: argparse.Namespace, cert: str, key: str) -> dict[str, Any]:
    load = [os.getloadavg()[0]]
    rounds = with_producer(producer, (args.mb, cert, key), lambda info: tensor_rounds(info, args, cert))
    load.append(os.getloadavg()[0])
    out: dict[str, Any] = {"payload_mb": args.mb, "reps": args.reps, "small_gets_per_round": args.small,
                           "load_avg_1m": [round(x, 2) for x in load], "stores": {}}  # fmt: skip
    for name in STORES:
        med = {field: statistics.median(values) for field, values in rounds[name].items()}
        cpu = {op: [round(statistics.median(x[i] for x in CPU[f"{name}_{op}"][1:]), 3) for i in (0, 1)]
               for op in ("get", "put")}  # fmt: skip
        out["stores"][name] = {
            "get_mb_s": round(med["get"], 1), "put_mb_s": round(med["put"], 1),
            "small_get_ms": round(med["small_get_ms"], 3),
            "cpu_s_per_gib": cpu,  # [this process, the store's], all threads; warm-up dropped
            "rounds": {field: [round(x, 3) for x in values] for field, values in rounds[name].items()},
        }  # fmt: skip
    for name in STORES[1:]:
        this, base = out["stores"][name], out["stores"]["plain"]
        this["vs_plain"] = {
            "get_mb_s": round(this["get_mb_s"] / base["get_mb_s"], 3),
            "put_mb_s": round(this["put_mb_s"] / base["put_mb_s"], 3),
            "small_get_ms": round(this["small_get_ms"] / base["small_get_ms"], 3),
            "get_cpu": round(sum(this["cpu_s_per_gib"]["get"]) / sum(base["cpu_s_per_gib"]["get"]), 3),
            "put_cpu": round(sum(this["cpu_s_per_gib"]["put"]) / sum(base["cpu_s_per_gib"]["put"]), 3),
        }
    return out


# --- a run's step ------------------------------------------------------------------------------


def _nats_setting(mode: str, cert: str, key: str) -> str:
    return {"open": "open", "roles": "", "roles_tls": f"tls:{cert},{key}"}[mode]


class Turns:
    """Runs in threads of their own take turns at stepping, in ``schedule``'s order. A run that
    waits keeps its event loop turning: its controller would otherwise miss its workers' heartbeats
    and declare them dead. Starts take a lock (the launcher's variable is process-wide)."""

    def __init__(self, schedule: list[str], args: argparse.Namespace) -> None:
        self.schedule, self.args = schedule, args
        self.pos, self.started = 0, 0
        self.start_lock, self.lock = threading.Lock(), threading.Lock()
        self.rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in NATS_MODES}
        self.load = [os.getloadavg()[0]]
        self.error: BaseException | None = None

    def drive(self, mode: str, trainer: Any, setting: str) -> None:
        """One run's thread: start it, step it in its turns, wait for the others, close it."""
        try:
            with self.start_lock:
                os.environ[BENCHMARK_NATS_ENV] = setting
                try:
                    trainer.start()  # the launcher reads the variable here
                finally:
                    del os.environ[BENCHMARK_NATS_ENV]
                self.started += 1
            steps = trainer.steps(num_epochs=100, max_steps=self.schedule.count(mode))
            self._wait(trainer, lambda: self.started == len(NATS_MODES))
            for _ in range(self.schedule.count(mode)):
                self._wait(trainer, lambda: self.schedule[self.pos] == mode)
                m = next(steps).metrics
                self.rows[mode].append({"step_s": m["time/step_s"], **{p: m[f"time/{p}_s"] for p in PHASES},
                                        "reward": m["reward/mean"], "loss": m["loss"]})  # fmt: skip
                self._advance()
            self._wait(trainer, lambda: self.pos == len(self.schedule))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self.error = self.error or exc
        finally:
            trainer.close()

    def _wait(self, trainer: Any, ready: Callable[[], bool]) -> None:
        while not ready():
            if self.error is not None:
                raise RuntimeError("another run failed")
            trainer.run(asyncio.sleep(0.05))

    def _advance(self) -> None:
        with self.lock:
            self.pos += 1
            if self.pos % len(NATS_MODES):
                return
            step = self.pos // len(NATS_MODES) - 1
            self.load.append(os.getloadavg()[0])
        times = "  ".join(f"{mode} {self.rows[mode][-1]['step_s']:.3f}s" for mode in NATS_MODES)
        print(f"step {step}{' (warm-up)' if step < self.args.warmup else ''}: {times}", flush=True)


def step_part(args: argparse.Namespace, cert: str, key: str, out: Path) -> dict[str, Any]:
    """The job three times, one per NATS mode, stepped in turn; per mode the rows after warm-up."""
    schedule = [
        m for step in range(args.warmup + args.steps) for m in NATS_MODES[step % 3 :] + NATS_MODES[: step % 3]
    ]
    turns = Turns(schedule, args)
    threads = []
    for mode in NATS_MODES:
        run = (mode, build(args, out / mode), _nats_setting(mode, cert, key))
        threads.append(threading.Thread(target=turns.drive, args=run, name=f"run-{mode}"))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if turns.error is not None:
        raise turns.error
    rows, load = turns.rows, turns.load
    timed = {mode: r[args.warmup :] for mode, r in rows.items()}
    result: dict[str, Any] = {"job": args.job, "overrides": args.overrides, "steps": args.steps,
                              "warmup": args.warmup, "load_avg_1m": [round(x, 2) for x in load]}  # fmt: skip
    for mode in NATS_MODES:
        result[mode] = {
            k: round(statistics.median(r[k] for r in timed[mode]), 4) for k in ("step_s", *PHASES)
        }
    for mode in NATS_MODES[1:]:
        # the median of each step's ratio to the open run's same step (they ran back to back)
        paired = [a["step_s"] / b["step_s"] - 1 for a, b in zip(timed[mode], timed["open"], strict=True)]
        result[mode]["overhead"] = round(result[mode]["step_s"] / result["open"]["step_s"] - 1, 4)
        result[mode]["overhead_paired"] = round(statistics.median(paired), 4)
    result["rows"] = timed
    return result


# --- report ------------------------------------------------------------------------------------


def print_tables(report: dict[str, Any]) -> None:
    tensors = report.get("tensor_plane")
    if tensors:
        print(f"\ntensor plane, {tensors['payload_mb']} MiB, median of {tensors['reps']} rounds "
              f"(load avg {tensors['load_avg_1m']})")  # fmt: skip
        print("| store | get MB/s | put MB/s | 1 KiB get ms | CPU s/GiB get | CPU s/GiB put |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, s in tensors["stores"].items():
            get, put = (sum(s["cpu_s_per_gib"][op]) for op in ("get", "put"))
            print(f"| {name} | {s['get_mb_s']:.0f} | {s['put_mb_s']:.0f} | {s['small_get_ms']:.2f} | "
                  f"{get:.2f} | {put:.2f} |")  # fmt: skip
    step = report.get("step")
    if step:
        print(f"\n{step['job']}, median of {step['steps']} steps (load avg {min(step['load_avg_1m'])}"
              f"-{max(step['load_avg_1m'])})")  # fmt: skip
        print("| NATS | " + " | ".join(f"{k} s" for k in ("step", *PHASES)) + " | vs open | paired |")
        print("| --- " * (len(PHASES) + 4) + "|")
        for mode in NATS_MODES:
            r = step[mode]
            vs = f"{r['overhead']:+.1%} | {r['overhead_paired']:+.1%}" if "overhead" in r else "- | -"
            print(f"| {mode} | " + " | ".join(f"{r[k]:.3f}" for k in ("step_s", *PHASES)) + f" | {vs} |")
        print("target: roles_tls under +5% on the step")
    cpus = report["machine"]["cpus"] or 1
    loads = [x for part in (tensors, step) if part for x in part["load_avg_1m"]]
    if loads and max(loads) > cpus:
        print(f"warning: load average up to {max(loads)} on {cpus} CPUs: other processes shared the cores")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=256, help="tensor payload in MiB")
    p.add_argument("--reps", type=int, default=5, help="timed tensor rounds (after one warm-up round)")
    p.add_argument("--small", type=int, default=100, help="1 KiB gets per store per round")
    p.add_argument("--job", default="examples/tiny_grpo.yaml", help="job file, as for rlfleet train")
    p.add_argument("--steps", type=int, default=10, help="timed steps per NATS mode")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--skip-tensor", action="store_true", help="only the step part")
    p.add_argument("--skip-step", action="store_true", help="only the tensor part")
    p.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON results")
    p.add_argument("overrides", nargs="*", help="key=value job overrides")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    return smoke.parse(p, None, {"mb": 32, "reps": 1, "small": 2, "steps": 1, "warmup": 0})


def main() -> int:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    report: dict[str, Any] = {"command": " ".join(["python", *sys.argv])}
    with tempfile.TemporaryDirectory(prefix="rlfleet-security-bench-") as tmp:
        cert, key = self_signed(Path(tmp))
        if not args.skip_tensor:
            report["tensor_plane"] = tensor_part(args, cert, key)
        if not args.skip_step:
            report["step"] = step_part(args, cert, key, Path(tmp) / "runs")
    report["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    report["unix_time"] = int(time.time())
    print_tables(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
