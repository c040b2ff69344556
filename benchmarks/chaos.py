"""Chaos run: a tiny GRPO job with a worker killed every few steps, as a user runs it (issue 12).

    uv run --extra cpu python benchmarks/chaos.py                       # 45 steps, a fault every 6
    uv run --extra cpu python benchmarks/chaos.py --steps 20 --every 4
    uv run --extra cpu python benchmarks/chaos.py --smoke               # 4 steps, one fault (CI's check)

``python -m rlfleet.controller.cli train JOB max_steps=N save_every=5 ...`` runs as a subprocess.
This script watches its ``output_dir/metrics.jsonl`` (one line per step, with the step's end time)
and ``output_dir/fleet/processes.json`` (the launcher's pids) and, every ``--every`` steps, injects
the next fault in turn:

- ``rollout``: SIGKILL a rollout worker (the launcher starts it again under its id);
- ``reward``: SIGKILL the reward worker (likewise);
- ``nats``: SIGKILL the run's own nats-server (the launcher starts it again on its port with the
  same configuration; every client reconnects and the step goes on);
- ``trainer``: SIGKILL the trainer (the run restores it from the last checkpoint, its steps after
  that come again);
- ``controller``: SIGKILL the controller process itself (its workers die with it), then start the
  same command again with ``resume_from=auto`` (it goes on from the latest complete checkpoint);
- ``frozen``: SIGSTOP a rollout worker (alive, silent): the run's registry declares it dead after
  ``faults.dead_after_s``, the launcher SIGKILLs that process and starts it again, and the work it
  held waits for it (issue 29; the run's only rollout worker in the tiny job);
- ``sync``: SIGKILL a rollout worker during the weight sync: as soon as the trainer's log says it
  staged the next weight version (``staged weight version N``), before the worker has loaded it
  (whether it landed before the worker's ``loaded weight version N`` line is recorded as
  ``landed``); the sync waits for the restarted worker (issue 29).

Recorded (``benchmarks/results/chaos.json``): each fault (kind, the step when it was sent, the pid,
whether the run went on), the distinct steps completed (a replayed step counts once), samples lost
(expected ``batch.rollout_batch_size x batch.group_size`` per step, or a samples metric if the run
logs one, against what the completed steps trained), the longest gap between consecutive metric
lines and the time from each fault to the next step line, the exit code, and the machine and its
load average.
The issue's target: every fault survived, 0 samples lost, every stall under 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import smoke

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "chaos.json"
KINDS = ("rollout", "reward", "nats", "trainer", "controller", "frozen", "sync")
AIMED = {"frozen": "rollout", "sync": "rollout"}
"""Faults aimed at a worker of another kind's tier (the rest aim at the tier they are named after)."""
LOG_POLL_S = 0.002
"""How often ``sync`` looks at the trainer's log: the tiny job's weight load takes tens of ms."""
SAMPLE_KEYS = ("samples", "num_samples", "train/samples", "rollout/samples", "batch/samples")
NOT_INJECTED: list[dict[str, str]] = []
"""Faults of the issue's list this run does not inject, with why (none now: the embedded
nats-server is restarted by the launcher since issue 12, so its restart is injected too)."""
STALL_TARGET_S = 60.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", default="examples/tiny_grpo.yaml")
    p.add_argument("--steps", type=int, default=45, help="max_steps of the run (45: each kind once)")
    p.add_argument("--every", type=int, default=6, help="steps between faults")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument(
        "--epochs",
        type=int,
        default=4,
        help="num_epochs: enough that max_steps ends the run (tiny_digits: 12 steps an epoch)",
    )
    p.add_argument("--phase-timeout", type=float, default=180.0, help="give up waiting for a step after this")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("overrides", nargs="*", help="more key=value job overrides")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    return smoke.parse(p, None, {"steps": 4, "every": 2, "save_every": 2, "phase_timeout": 120.0})


class Watch:
    """What the run has logged so far: every metric line seen, across the run's restarts."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.lines: list[dict[str, Any]] = []
        self._current: list[dict[str, Any]] = []  # the lines of the current metrics.jsonl already taken

    def poll(self) -> None:
        """Take the new lines. A trainer restored from a checkpoint rewinds ``metrics.jsonl`` to it
        (the replayed steps are written again in place), so a line is new where it differs from the
        one seen at its position, not only past the end."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        text = path.read_text()
        complete = text.split("\n")[:-1]  # a line still being written has no newline yet
        now = [json.loads(line) for line in complete if line.strip()]
        same = 0
        while same < min(len(now), len(self._current)) and now[same] == self._current[same]:
            same += 1
        self.lines.extend(now[same:])
        self._current = now

    def set_aside(self, name: str) -> None:
        """Take the rest of this metrics.jsonl and move it away (a resumed run writes a new one)."""
        self.poll()
        path = self.out / "metrics.jsonl"
        if path.exists():
            path.rename(self.out / name)
        self._current = []

    @property
    def last_step(self) -> int:
        return self.lines[-1]["step"] if self.lines else 0

    @property
    def steps(self) -> set[int]:
        return {line["step"] for line in self.lines}


def pids(out: Path) -> dict[str, int]:
    """``{worker_id: pid}`` from the launcher's processes.json, plus the controller's and the
    nats-server's pids."""
    try:
        data = json.loads((out / "fleet" / "processes.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    found = {w["worker_id"]: int(w["pid"]) for w in data["workers"]}
    found["controller"] = int(data["controller_pid"])
    if data.get("nats"):
        found["nats-server"] = int(data["nats"]["pid"])
    return found


def tier_pid(out: Path, kind: str) -> tuple[str, int]:
    data = json.loads((out / "fleet" / "processes.json").read_text())
    if kind == "controller":
        return "controller", int(data["controller_pid"])
    if kind == "nats":
        return "nats-server", int(data["nats"]["pid"])
    worker = next(w for w in data["workers"] if w["tier"] == AIMED.get(kind, kind))
    return worker["worker_id"], int(worker["pid"])


def worker_log(out: Path, tier: str) -> Path:
    """The log file of the run's first worker of ``tier`` (from processes.json)."""
    data = json.loads((out / "fleet" / "processes.json").read_text())
    return Path(next(w for w in data["workers"] if w["tier"] == tier)["log"])


def wait_line(
    proc: subprocess.Popen[bytes], log: Path, pattern: re.Pattern[str], timeout: float
) -> str | None:
    """The first line matching ``pattern`` written to ``log`` from now on (None: the run ended or
    ``timeout`` passed first), read every :data:`LOG_POLL_S` s."""
    offset = log.stat().st_size if log.exists() else 0
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log, "rb") as f:
            f.seek(offset)
            text += f.read().decode(errors="replace")
        found = pattern.search(text)
        if found:
            return found.group(0)
        time.sleep(LOG_POLL_S)
    return None


def kill_during_sync(proc: subprocess.Popen[bytes], out: Path, fault: dict[str, Any], timeout: float) -> None:
    """SIGKILL the rollout worker as soon as the trainer staged the next weight version; record in
    ``fault`` which version and whether the worker had loaded it already (``landed``)."""
    staged = wait_line(proc, worker_log(out, "trainer"), re.compile(r"staged weight version (\d+)"), timeout)
    if staged is None:
        fault["landed"] = "no weight sync seen"
        os.kill(fault["pid"], signal.SIGKILL)
        return
    version = int(staged.rsplit(" ", 1)[1])
    os.kill(fault["pid"], signal.SIGKILL)
    loaded = f"loaded weight version {version} "
    text = worker_log(out, "rollout").read_text(errors="replace")
    fault["weight_version"] = version
    fault["landed"] = "after the worker loaded it" if loaded in text else "during the weight sync"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def all_gone(wanted: list[int], timeout: float) -> bool:
    """Whether every pid in ``wanted`` is gone within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in wanted):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def wait_for(proc: subprocess.Popen[bytes], watch: Watch, done, timeout: float) -> bool:
    """Poll until ``done()``; False when the run ended or ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        watch.poll()
        if done():
            return True
        if proc.poll() is not None:
            watch.poll()
            return bool(done())
        time.sleep(0.05)
    return False


def samples_per_step(job: str, overrides: list[str]) -> int:
    """``batch.rollout_batch_size x batch.group_size`` of the job with its overrides, as the run reads it."""
    from rlfleet.common.schema.config import load_config
    from rlfleet.controller.config import JobConfig

    batch = load_config(JobConfig, REPO / job, overrides).batch
    return batch.rollout_batch_size * batch.group_size


def start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as f:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / "run"
    overrides = [f"output_dir={out}", f"max_steps={args.steps}", f"save_every={args.save_every}",
                 "loggers=[jsonl]", "sample_table_size=0", "log_every=1",
                 f"num_epochs={args.epochs}", *args.overrides]  # fmt: skip
    command = [sys.executable, "-m", "rlfleet.controller.cli", "train", args.job, *overrides]
    per_step = samples_per_step(args.job, overrides)
    log = work / "controller.log"
    load_before = os.getloadavg()
    started = time.time()
    proc = start(command, log)
    watch = Watch(out)
    faults: list[dict[str, Any]] = []
    exit_codes: list[int | None] = []
    targets = list(range(args.every, args.steps, args.every))
    frozen: list[int] = []  # processes this script stopped: never left behind stopped
    try:
        for i, target in enumerate(targets):
            kind = KINDS[i % len(KINDS)]
            if not wait_for(proc, watch, lambda t=target: watch.last_step >= t, args.phase_timeout):
                break
            if kind == "trainer" and not list(out.glob("checkpoint-*/controller_state.json")):
                kind = "rollout"  # nothing to restore from yet; keep the run honest about it
            name, pid = tier_pid(out, kind)
            before = pids(out)
            fault = {"kind": kind, "worker": name, "pid": pid, "at_step": watch.last_step,
                     "at_time": round(time.time(), 3)}  # fmt: skip
            if kind == "sync":
                kill_during_sync(proc, out, fault, args.phase_timeout)
                fault["at_time"] = round(time.time(), 3)
            elif kind == "frozen":
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
            else:
                os.kill(pid, signal.SIGKILL)
            if kind == "controller":
                proc.wait(timeout=30)
                exit_codes.append(proc.returncode)
                fault["workers_gone_with_it"] = all_gone(list(before.values()), 40.0)
                watch.set_aside(f"metrics.before_resume_{len(exit_codes)}.jsonl")
                proc = start([*command, "resume_from=auto"], log)
            seen = len(watch.lines)
            went_on = wait_for(proc, watch, lambda s=seen: len(watch.lines) > s, args.phase_timeout)
            fault["next_step_line"] = watch.lines[seen]["step"] if went_on else None
            fault["to_next_step_s"] = (
                round(watch.lines[seen]["time"] - fault["at_time"], 3) if went_on else None
            )
            after = pids(out)
            fault["new_pid"] = after.get(name)
            fault["survived"] = bool(went_on and after.get(name) not in (None, pid))
            if kind == "frozen":  # the run, not this script, ended the stopped process
                fault["killed_by_run"] = not alive(pid)
                fault["survived"] = fault["survived"] and fault["killed_by_run"]
            if not went_on and proc.poll() == 0:
                fault["landed_after_last_step"] = True  # the run was already finishing
            faults.append(fault)
            print(f"fault {kind:<10} pid {pid:>7} at step {fault['at_step']:>3}: next step in "
                  f"{fault['to_next_step_s']} s, survived={fault['survived']}", flush=True)  # fmt: skip
        proc.wait(timeout=args.phase_timeout * 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in frozen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    exit_codes.append(proc.returncode)
    watch.poll()
    return summarise(args, command, per_step, watch, faults, exit_codes, started, load_before, log)


def summarise(args, command, per_step, watch, faults, exit_codes, started, load_before, log):
    lines = watch.lines
    sample_key = next((k for k in SAMPLE_KEYS if lines and k in lines[0]), None)
    trained: dict[int, float] = {}
    for line in lines:  # a replayed step counts once: its last run is the one the model kept
        trained[line["step"]] = float(line[sample_key]) if sample_key else float(per_step)
    expected = args.steps * per_step
    times = [line["time"] for line in lines]
    gaps = [round(b - a, 3) for a, b in zip(times, times[1:], strict=False)]
    longest_gap = max(gaps, default=None)
    fault_stalls = [f["to_next_step_s"] for f in faults if f["to_next_step_s"] is not None]
    worst = max([*(gaps or [0.0]), *fault_stalls])
    result = {
        "command": " ".join(["python", *sys.argv]),
        "run_command": " ".join(["python", *command[1:]]),
        "job": args.job,
        "max_steps": args.steps,
        "fault_every_steps": args.every,
        "save_every": args.save_every,
        "expected_samples_per_step": per_step,
        "samples_basis": sample_key
        or "batch.rollout_batch_size x batch.group_size per completed step (the run logs no samples metric)",
        "faults_injected": faults,
        "not_injected": NOT_INJECTED,
        "faults_survived": sum(f["survived"] for f in faults),
        "faults_total": len(faults),
        "metric_lines": len(lines),
        "steps_completed": len(trained),
        "steps_replayed": len(lines) - len(trained),
        "samples_expected": expected,
        "samples_trained": int(sum(trained.values())),
        "samples_lost": int(expected - sum(trained.values())),
        "startup_s": round(times[0] - started, 3) if times else None,
        "longest_gap_between_steps_s": longest_gap,
        "fault_to_next_step_s": fault_stalls,
        "longest_stall_s": round(worst, 3),
        "stall_target_s": STALL_TARGET_S,
        "run_said_done": [
            line for line in log.read_text(errors="replace").splitlines() if line.startswith("done: ")
        ],  # fmt: skip
        "exit_codes": exit_codes,
        "exit_code": exit_codes[-1],
        "wall_s": round(time.time() - started, 1),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "controller_log_tail": log.read_text(errors="replace").splitlines()[-8:],
    }
    result["target_met"] = bool(
        result["faults_survived"] == len(faults) and result["samples_lost"] == 0
        and result["longest_stall_s"] < STALL_TARGET_S and result["exit_code"] == 0
    )  # fmt: skip
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'fault':<11}{'pid':>8}{'at step':>9}{'next step':>11}{'stall s':>9}  survived")
    for f in result["faults_injected"]:
        note = f"  ({f['landed']})" if "landed" in f else ""
        print(f"{f['kind']:<11}{f['pid']:>8}{f['at_step']:>9}{str(f['next_step_line']):>11}"
              f"{str(f['to_next_step_s']):>9}  {f['survived']}{note}")  # fmt: skip
    for f in result["not_injected"]:
        print(f"{f['kind']:<11}{'-':>8}{'-':>9}{'-':>11}{'-':>9}  not injected")
    r = result
    print(f"\nsurvived {r['faults_survived']}/{r['faults_total']}, steps {r['steps_completed']}"
          f"/{r['max_steps']} ({r['steps_replayed']} replayed lines), samples lost {r['samples_lost']} of"
          f" {r['samples_expected']},"
          f" longest gap {r['longest_gap_between_steps_s']} s, longest stall {r['longest_stall_s']} s, exit"
          f" {r['exit_code']}, load {r['load_avg_after']}, target met: {r['target_met']}")  # fmt: skip


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-chaos-") as tmp:
        result = run(args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
