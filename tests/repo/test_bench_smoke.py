"""Benchmarks cannot rot: every benchmark script takes ``--smoke``, which CI runs.

``scripts/bench_smoke.py`` runs them all in smoke mode (``.ci/run``); these tests only read the
source (``ast``), check that the CI step is there, and check ``benchmarks/smoke.py``'s parsing.
They run no benchmark.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (a dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


RUNNER = _load(ROOT / "scripts" / "bench_smoke.py", "rlfleet_bench_smoke")
SMOKE = _load(ROOT / "benchmarks" / "smoke.py", "rlfleet_benchmarks_smoke")
SCRIPTS = RUNNER.entry_scripts()


def test_the_benchmark_scripts_are_found() -> None:
    names = {path.name for path in SCRIPTS}
    assert {"chaos.py", "trainer.py", "vs_trl.py", "gpu_grpo.py"} <= names
    assert not {"smoke.py", "gpu_memory.py", "tree_memory.py", "heldout_targets.py"} & names  # helpers


@pytest.mark.parametrize("script", sorted(SCRIPTS), ids=lambda p: p.name)
def test_every_benchmark_script_declares_smoke(script: Path) -> None:
    assert SCRIPTS[script], f"{script.name} has a main but no --smoke flag (see benchmarks/smoke.py)"


def test_a_script_without_the_flag_is_named(tmp_path: Path) -> None:
    (tmp_path / "helper.py").write_text("X = 1\n")
    (tmp_path / "bare.py").write_text("import argparse\nif __name__ == '__main__':\n    pass\n")
    (tmp_path / "good.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--smoke', action='store_true')\n"
        "if __name__ == '__main__':\n    p.parse_args()\n"
    )
    assert {p.name: smoke for p, smoke in RUNNER.entry_scripts(tmp_path).items()} == {
        "bare.py": False,
        "good.py": True,
    }


def test_ci_runs_the_benchmark_smoke_step() -> None:
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "uv run --extra cpu --group bench python scripts/bench_smoke.py" in steps


def _parser(default_out: Path) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=6)
    p.add_argument("--out", type=Path, default=default_out)
    p.add_argument("--smoke", action="store_true", help=SMOKE.HELP)
    return p


def test_smoke_sets_defaults_that_given_flags_override(tmp_path: Path) -> None:
    results = tmp_path / "results" / "chaos.json"
    plain = SMOKE.parse(_parser(results), ["--steps", "3"], {"steps": 4, "every": 2})
    assert (plain.steps, plain.every, plain.out) == (3, 6, results)  # without --smoke: untouched
    args = SMOKE.parse(_parser(results), ["--smoke", "--every", "1"], {"steps": 4, "every": 2})
    assert (args.steps, args.every) == (4, 1)
    assert args.out.name == "chaos.json" and args.out.parent != results.parent  # never the results folder
    assert not args.out.parent.exists()  # created only by a run that writes
    given = SMOKE.parse(_parser(results), ["--smoke", "--out", str(tmp_path / "x.json")], {"steps": 4})
    assert given.out == tmp_path / "x.json"


def test_smoke_settings_must_name_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stepz"):
        SMOKE.parse(_parser(tmp_path / "r.json"), ["--smoke"], {"stepz": 1})
