"""The console scripts a new user meets first (issue 35, point 4), run as subprocesses:
``rlfleet --version``, ``rlfleet env``, ``rlfleet config --fields``, ``rlfleet train --help``, a
foreign key on the command line (exit 2, one line), and ``rlfleet status --run`` on a run that ended."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlfleet.controller.config import JobConfig
from rlfleet.controller.config_fields import MAIN_KEYS

pytestmark = pytest.mark.timeout(120)

RLFLEET = str(Path(sys.executable).with_name("rlfleet"))
TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_grpo.yaml"


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RLFLEET, *args], capture_output=True, text=True, timeout=100, cwd=cwd)


def test_version_prints_the_controllers_release() -> None:
    from importlib import metadata

    shown = _run("--version")
    assert (
        shown.returncode == 0 and shown.stdout.strip() == f"rlfleet {metadata.version('rlfleet-controller')}"
    )


def test_env_reports_packages_torch_cuda_and_cpu_features() -> None:
    shown = _run("env")
    assert shown.returncode == 0, shown.stderr
    rows = dict(line.split(None, 1) for line in shown.stdout.splitlines())
    for name in ("rlfleet-common", "rlfleet-controller", "rlfleet-rollout", "rlfleet-trainer", "torch",
                 "transformers", "vllm", "python", "cpu", "cuda"):  # fmt: skip
        assert name in rows, (name, shown.stdout)
    import torch

    assert rows["torch"] == torch.__version__.split("+")[0] or rows["torch"] == torch.__version__
    assert ("available" in rows["cuda"]) and ("not available" in rows["cuda"]) != torch.cuda.is_available()
    assert "flags:" in rows["cpu"]


def test_config_fields_is_yaml_of_every_key_with_its_description() -> None:
    shown = _run("config", "--fields")
    assert shown.returncode == 0, shown.stderr
    loaded = yaml.safe_load(shown.stdout)
    assert set(loaded) == set(JobConfig.model_fields)
    assert loaded["batch"]["group_size"] == 4 and loaded["update"]["learning_rate"] == 1e-6
    assert loaded["kl"] == {"type": "fixed"} and loaded["rollout"]["engine"] == {"type": "hf"}
    lines = shown.stdout.splitlines()
    at = lines.index("  group_size: 4")
    assert lines[at - 1].startswith("  # samples per prompt"), lines[at - 1]
    assert "name: null  # (required)" in shown.stdout  # model.name


def test_config_without_a_job_file_or_with_both_exits_2_in_one_line() -> None:
    for args in (("config",), ("config", str(TINY), "--fields")):
        shown = _run(*args)
        assert shown.returncode == 2 and len(shown.stderr.strip().splitlines()) == 1, shown.stderr


def test_train_help_lists_the_main_keys_and_how_to_list_them_all() -> None:
    shown = _run("train", "--help")
    assert shown.returncode == 0
    for key in MAIN_KEYS:
        assert f"  {key} " in shown.stdout, key
    assert "rlfleet config --fields" in shown.stdout
    top = _run("--help")
    assert (
        "env" in top.stdout
        and "--version" in top.stdout
        and "config --fields" in " ".join(top.stdout.split())
    )


def test_a_trl_name_on_the_command_line_exits_2_with_the_suggestion_alone(tmp_path: Path) -> None:
    shown = _run("train", str(TINY), "num_generations=8", f"output_dir={tmp_path / 'out'}")
    assert shown.returncode == 2
    said = "unknown field; did you mean 'group_size'? (num_generations is TRL's name)"
    assert shown.stderr.strip() == f"rlfleet: config field 'num_generations' = 8: {said}"
    beta = _run("config", str(TINY), "algorithm.beta=0.04")
    assert beta.returncode == 2 and "has no effect under grpo" in beta.stderr and "kl_coef" in beta.stderr
    assert len(beta.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_status_of_a_run_that_ended_says_so_with_its_last_step(tmp_path: Path) -> None:
    """A finished run's folder: its controller (a process that has exited) is gone; ``status --run``
    answers from the folder instead of trying the run's NATS server."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run = tmp_path / "run"
    (run / "fleet").mkdir(parents=True)
    (run / "final").mkdir()
    (run / "fleet" / "processes.json").write_text(json.dumps({"controller_pid": gone.pid, "workers": []}))
    login = {
        "nats_url": "nats://127.0.0.1:9",
        "cluster": "run-x",
        "nats_auth": {"user": "o", "password": "p"},
    }
    (run / "fleet" / "status.yaml").write_text(yaml.safe_dump(login))
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3))
    )
    (run / "config.yaml").write_text("max_steps: 3\n")
    shown = _run("status", "--run", str(run))
    assert shown.returncode == 0, shown.stderr
    assert (
        shown.stdout.strip()
        == f"run {run}: the run has ended at step 3 of 3 (final model in {run / 'final'})"
    )
