"""Multi-turn runs against a shared, multi-tenant reward server's environments (issue 33, point 1).

Real processes throughout: a nats-server for the shared tier, ``rlfleet-reward serve --config``
serving the ``calc`` environment and an ``episode`` endpoint to two tenants, and ``rlfleet train``
runs of the tiny calculator job with their own nats-server, trainer and rollout worker, whose
episodes play the shared server's environment (``environment.env`` alone, ``reward.url``). The
rollout worker reaches that server over its own connection and sends the run's tenant token with
every environment request: team A's run trains on its episodes; team B, whose token does not cover
``calc``, gets the server's refusal by name and a failed run, never a run trained on rewards of 0.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "examples" / "calculator_tiny.yaml"
TOKEN_A, TOKEN_B = "team-a-token-1234", "team-b-token-5678"
CLUSTER = "shared-envs"


@pytest.fixture
def shared_server(nats_server: EmbeddedNats, tmp_path: Path, spawn, cli_env: dict[str, str]) -> Path:
    config = {
        "fleet": {"nats_url": nats_server.url, "cluster": CLUSTER}, "worker_id": "reward-shared",
        "endpoints": {"team-a/calc": "episode", "team-b/calc": "episode"},
        "environments": {"calc": "calculator:max_turns=3"},
        "tenants": [
            {"name": "team-a", "token": TOKEN_A, "endpoints": ["team-a/calc", "calc"]},
            {"name": "team-b", "token": TOKEN_B, "endpoints": ["team-b/calc"]},  # not the environment
        ],
    }  # fmt: skip
    path = tmp_path / "reward.yaml"
    path.write_text(yaml.safe_dump(config))
    spawn.serve("reward-server", path, env=cli_env)
    return spawn.log_path("reward-server")


def _train(venv_script, nats_url: str, out: Path, team: str, token: str, env: dict[str, str]):  # noqa: ANN001, ANN202
    command = [venv_script("rlfleet"), "train", str(JOB), "max_steps=3", f"output_dir={out}",
               "sample_table_size=0", "loggers=[jsonl]", "environment.serve=", f"reward.url={nats_url}",
               f"reward.cluster={CLUSTER}", f"reward.endpoint={team}/calc"]  # fmt: skip
    # the token in the controller's environment, as an operator hands it (never on the command line)
    return subprocess.run(command, cwd=REPO, env={**env, "RLFLEET_REWARD_TOKEN": token},
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_runs_play_a_shared_servers_environment_with_their_tenant_token(
    nats_server: EmbeddedNats, shared_server: Path, tmp_path: Path, venv_script, cli_env, procs,
    tiny_model_dir,
) -> None:  # fmt: skip
    a = _train(venv_script, nats_server.url, tmp_path / "a", "team-a", TOKEN_A, cli_env)
    assert a.returncode == 0, a.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["episode/turns_mean"] >= 1.0 and "episode/env_s_mean" in row for row in rows)
    assert all(row["reward/episode"] == pytest.approx(row["reward/mean"]) for row in rows)
    rollout_log = (tmp_path / "a" / "fleet" / "workers" / "rollout-0.log").read_text()
    assert "environments on the reward servers at" in rollout_log
    assert "env_error" not in rollout_log, rollout_log[-2000:]  # every episode ended by the environment
    assert procs.survivors(procs.launched(tmp_path / "a")) == []

    b = _train(venv_script, nats_server.url, tmp_path / "b", "team-b", TOKEN_B, cli_env)
    assert b.returncode != 0
    said = b.stderr + b.stdout
    assert "refused environment 'calc' (forbidden_endpoint)" in said, said[-3000:]
    assert "tenant 'team-b' may not use environment 'calc'" in said
    assert (
        not (tmp_path / "b" / "metrics.jsonl").exists() or not (tmp_path / "b" / "metrics.jsonl").read_text()
    )
    assert procs.survivors(procs.launched(tmp_path / "b")) == []
