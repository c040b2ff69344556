"""Run every benchmark in smoke mode, so that none of them rots (CI runs this after the tests).

Every ``benchmarks/*.py`` with an ``if __name__ == "__main__":`` block must declare ``--smoke``
(``add_argument("--smoke", ...)``; ``benchmarks/smoke.py`` says what a smoke run is); one that does
not fails the run by name before anything starts. Each script then runs as
``python benchmarks/<name>.py --smoke --out <temp>/<name>.json`` with this interpreter, from the
repository root, one after the other, in its own process group (a timeout stops the whole tree it
started: a fleet's workers too). One line per script: name, seconds, ok or FAILED; then the end of
each failed script's output. The exit code is 1 when any failed.

    uv run --extra cpu --group bench python scripts/bench_smoke.py            # all of them
    uv run --extra cpu --group bench python scripts/bench_smoke.py chaos reward
"""

from __future__ import annotations

import argparse
import ast
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TAIL_CHARS = 4000


def has_main(tree: ast.Module) -> bool:
    """Whether the module runs as a script (a top-level ``if __name__ == "__main__":``)."""
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            sides = [node.test.left, *node.test.comparators]
            names = {s.id for s in sides if isinstance(s, ast.Name)}
            values = {s.value for s in sides if isinstance(s, ast.Constant)}
            if names == {"__name__"} and values == {"__main__"}:
                return True
    return False


def declares_smoke(tree: ast.Module) -> bool:
    """Whether the module calls ``add_argument("--smoke", ...)`` somewhere."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "--smoke"
        for node in ast.walk(tree)
    )


def entry_scripts(folder: Path = BENCHMARKS) -> dict[Path, bool]:
    """Every script of ``folder`` that runs as a script, and whether it declares ``--smoke``."""
    found = {}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        if has_main(tree):
            found[path] = declares_smoke(tree)
    return found


@dataclass
class Outcome:
    """One script's smoke run: its exit code (None: timed out), seconds and output."""

    script: Path
    returncode: int | None
    seconds: float
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_one(script: Path, out_dir: Path, timeout: float) -> Outcome:
    """``script --smoke`` in its own process group; the group is stopped if it outlives ``timeout``."""
    command = [sys.executable, str(script), "--smoke", "--out", str(out_dir / f"{script.stem}.json")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        seconds = time.perf_counter() - start
        # after a timeout at once; else whatever of its group outlived the script by 10 s
        left = stop_group(proc, grace=0.0 if code is None else 10.0)
        log.seek(0)
        output = log.read()
    if code is None:
        output += f"\n[bench_smoke] timed out after {timeout:.0f} s; its process group was stopped"
    elif left:
        output += "\n[bench_smoke] processes of its group outlived it by 10 s and were stopped"
    return Outcome(script, code, seconds, output)


def stop_group(proc: subprocess.Popen[str], grace: float) -> bool:
    """Give the process group ``proc`` leads ``grace`` seconds to end, then SIGTERM it and, 10 s
    later, SIGKILL it; whether any of it was still running after the grace."""

    def alive(within: float) -> bool:
        deadline = time.monotonic() + within
        while True:
            proc.poll()  # reap the leader once it ends: a zombie would keep its group alive
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return False
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.2)

    if not alive(grace):
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        if not alive(10.0):
            break
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="*", help="only these benchmarks (file stems; default: all)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one script may take")
    args = p.parse_args(argv)
    scripts = entry_scripts()
    lacking = [path.name for path, smoke in scripts.items() if not smoke]
    if lacking:
        print(f"benchmarks without a --smoke flag: {', '.join(lacking)} (see benchmarks/smoke.py)")
        return 1
    chosen = [path for path in scripts if not args.names or path.stem in args.names]
    unknown = set(args.names) - {path.stem for path in scripts}
    if unknown:
        p.error(f"no benchmark named {', '.join(sorted(unknown))}")
    outcomes = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-smoke-") as tmp:
        for script in chosen:
            outcome = run_one(script, Path(tmp), args.timeout)
            outcomes.append(outcome)
            status = "ok" if outcome.ok else "FAILED"
            print(f"{script.name:<26}{outcome.seconds:>7.1f} s  {status}", flush=True)
    failed = [o for o in outcomes if not o.ok]
    print(f"{len(outcomes) - len(failed)}/{len(outcomes)} ok in {time.perf_counter() - start:.1f} s")
    for outcome in failed:
        print(f"\n--- {outcome.script.name} (exit code {outcome.returncode}), the end of its output:")
        print(outcome.output[-TAIL_CHARS:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
