"""``rlfleet train examples/tiny_grpo.yaml`` for a dozen steps through real processes.

The CLI runs as a subprocess (the venv's ``rlfleet`` script) and starts a private nats-server
plus trainer, reward and rollout worker processes. The test checks what a user sees (the
``[PROGRESS]`` lines, exit code 0), that weights advance and reach the rollout worker every step,
that the policy learns (reward of the last steps beats the first), what lands in ``output_dir``,
and that every process the run started is gone.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from pathlib import Path

import pytest
import yaml

from rlfleet.common.schema.config import load_config
from rlfleet.controller.config import JobConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"
STEPS = 12
PROGRESS = re.compile(
    r"^\[PROGRESS\] Epoch (\d+)/(\d+) \| Step (\d+)/(\d+) "
    r"\| Loss: (\S+) \| Reward: (\S+) \| KL: (\S+)( \| .*)?$"
)


@pytest.mark.timeout(240)
def test_tiny_grpo_example_learns_through_real_processes(
    tmp_path: Path, venv_script, cli_env, tiny_model_dir, procs
) -> None:
    out = tmp_path / "run"
    command = [venv_script("rlfleet"), "train", str(EXAMPLE), f"max_steps={STEPS}", f"output_dir={out}"]
    run = subprocess.run(
        [*command, "log_every=1"], cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=220
    )
    assert run.returncode == 0, run.stderr[-3000:]

    progress = [PROGRESS.match(line) for line in run.stdout.splitlines() if line.startswith("[PROGRESS]")]
    assert len(progress) == STEPS and all(progress), run.stdout
    assert [int(m.group(3)) for m in progress] == list(range(1, STEPS + 1))
    assert {m.group(4) for m in progress} == {str(STEPS)}
    assert {m.group(7) for m in progress} == {"off"}, "kl_coef=0 runs without a reference: KL is off"

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["weight_version"] for row in rows] == list(range(1, STEPS + 1)), "one publish per step"
    assert [row["rollout/weight_version_min"] for row in rows] == [row["weight_version"] for row in rows]
    rewards = [row["reward/mean"] for row in rows]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.1, f"reward did not rise: {rewards}"

    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["max_response_length"] == load_config(JobConfig, EXAMPLE).max_response_length
    assert Path(saved["model_path"]).resolve() == tiny_model_dir.resolve()
    assert "Sample answers, before and after training" in (out / "samples.md").read_text()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.vocab_size > 0

    assert procs.survivors(procs.launched(out)) == []
