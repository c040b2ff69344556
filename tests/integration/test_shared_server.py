"""Two training runs with different tokens against one shared reward server, at the same time.

Real processes throughout: a nats-server, ``rlfleet-reward serve --config`` with two tenants, run B
as ``rlfleet train`` (its own nats-server, trainer and rollout worker, scoring on the shared
server) and run A as a library ``GRPOTrainer`` in this process, which switches its reward mid-run
(``set_reward_fn`` with a RewardScaler) and then hot-swaps its reward model
(``update_reward_model``) while training goes on. The metrics of run A show the step of each
version change; the operators' ``rlfleet-reward admin stats`` sees both tenants; each tenant sees
only its own endpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
TOKEN_A, TOKEN_B, ADMIN = "team-a-token-1234", "team-b-token-5678", "admin-token-0000"
CLUSTER = "shared-test"


def script(name: str) -> str:
    path = Path(sys.executable).parent / name
    assert path.exists(), f"{name} is not installed next to {sys.executable}"
    return str(path)


@pytest.fixture
def shared_server(
    nats_server: EmbeddedNats, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
    rlfleet_env: dict[str, str], spawn,
) -> Path:  # fmt: skip
    config = {
        "fleet": {"nats_url": nats_server.url, "cluster": CLUSTER}, "worker_id": "reward-shared",
        "max_concurrency": 4,
        "admin": {"token": ADMIN},
        "endpoints": {"team-a/digits": "charset:allowed=0123456789",
                      "team-b/short": "0.5*concise:max_words=3 + 0.5*exact_match:key=digits"},
        "tenants": [
            {"name": "team-a", "token": TOKEN_A, "endpoints": ["team-a/digits"], "requests_per_s": 100,
             "can_update": True, "model_dirs": [str(tmp_path_factory.getbasetemp())]},  # make_tiny_rm's
            {"name": "team-b", "token": TOKEN_B, "endpoints": ["team-b/short"], "max_batch": 256},
        ],
    }  # fmt: skip
    path = tmp_path / "reward.yaml"
    path.write_text(yaml.safe_dump(config))
    spawn.serve("reward-server", path, env=rlfleet_env)
    return spawn.log_path("reward-server")


@pytest.fixture
def rlfleet_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    cache = tmp_path_factory.getbasetemp() / "rlfleet-cache"
    monkeypatch.setenv("RLFLEET_CACHE", str(cache))
    return {**os.environ, "RLFLEET_CACHE": str(cache), "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}


def metrics(output_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def run_b(nats_url: str, out: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    command = [script("rlfleet"), "train", str(EXAMPLE), "max_steps=8", f"output_dir={out}",
               "sample_table_size=0", "rollout_batch_size=8", "train_batch_size=8", "group_size=4",
               "loggers=[jsonl]", f"reward.url={nats_url}", f"reward.cluster={CLUSTER}",
               "reward.endpoint=team-b/short", f"reward.token={TOKEN_B}"]  # fmt: skip
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def trainer_a(nats_url: str, out: Path, **extra: object):  # -> GRPOTrainer
    from rlfleet.controller import GRPOTrainer, TrainerConfig

    config = TrainerConfig(
        rollout_batch_size=8, train_batch_size=8, micro_batch_size=64, group_size=4, max_prompt_length=32,
        max_response_length=12, learning_rate=0.003, kl_coef=0.0, seed=0, output_dir=str(out),
        loggers=["jsonl"], sample_table_size=0,
        reward={"url": nats_url, "cluster": CLUSTER, "endpoint": "team-a/digits", "token": TOKEN_A}, **extra,
    )  # fmt: skip
    return GRPOTrainer("tiny:digits", "charset:allowed=0123456789", str(DATA), config)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_controllers_train_against_one_shared_server(
    nats_server: EmbeddedNats, shared_server: Path, tmp_path: Path, rlfleet_env: dict[str, str],
    make_tiny_rm: Callable[..., Path],
) -> None:  # fmt: skip
    from rlfleet.reward import RewardScaler, build_reward

    rm1, rm2 = make_tiny_rm(num_labels=1, seed=1), make_tiny_rm(num_labels=1, seed=2)
    b = run_b(nats_server.url, tmp_path / "b", rlfleet_env)
    trainer = trainer_a(nats_server.url, tmp_path / "a")
    try:
        versions: list[str] = []
        for result in trainer.steps(max_steps=6):
            if result.step == 1:
                assert b.poll() is None, "run B should still be training while run A trains"
            if result.step == 2:
                scaler = RewardScaler(fn=build_reward(f"charset:allowed=0123456789 + 0.1*rm:path={rm1}"),
                                      temperature=0.5, min_reward=0.0)  # fmt: skip
                versions.append(trainer.set_reward_fn(scaler.compute_reward))
            if result.step == 4:
                pending = trainer.update_reward_model(str(rm2), wait=False)  # training goes on meanwhile
        assert pending.done(), "the swap finished while steps 5 and 6 ran"
        versions.append(pending.result().spec_version)
        stats = trainer.reward_stats()
        assert list(stats.endpoints) == ["team-a/digits"] and stats.tenant == "team-a"
        assert f"path={rm2}" in stats.endpoints["team-a/digits"].spec
        assert stats.endpoints["team-a/digits"].scaler["temperature"] == 0.5
    finally:
        trainer.close()
    out_b, _ = b.communicate(timeout=300)
    assert b.returncode == 0, out_b[-3000:]

    rows_a = metrics(tmp_path / "a")
    revisions = [row["reward/spec_revision"] for row in rows_a]
    changed = [row["reward/spec_version_changed"] for row in rows_a]
    assert revisions[:4] == [0, 0, 1, 1] and revisions[-1] == 2 and revisions == sorted(revisions), revisions
    assert changed == [0.0] + [
        1.0 if now != before else 0.0 for before, now in zip(revisions, revisions[1:], strict=False)
    ]
    assert [v.rsplit("-r", 1)[1] for v in versions] == ["1", "2"]
    assert all("reward/raw_mean" in row for row in rows_a[2:]), "the scaler's raw scores are reported"
    rows_b = metrics(tmp_path / "b")
    assert len(rows_b) == 8 and {row["reward/spec_revision"] for row in rows_b} == {0.0}
    assert all(0.0 <= row["reward/mean"] <= 1.0 for row in rows_b)

    command = [
        script("rlfleet-reward"),
        "admin",
        "--nats",
        nats_server.url,
        "--cluster",
        CLUSTER,
        "--token",
        ADMIN,
    ]
    admin = subprocess.run([*command, "stats"], capture_output=True, text=True, timeout=60)
    assert admin.returncode == 0, admin.stderr
    seen = json.loads(admin.stdout.splitlines()[0])["endpoints"]
    assert seen["team-a/digits"]["requests"] >= 6 and seen["team-b/short"]["requests"] >= 8
    assert time.time() > 0 and "invalid_token" not in shared_server.read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pipelined_run_scores_on_the_shared_server(
    nats_server: EmbeddedNats, shared_server: Path, tmp_path: Path, rlfleet_env: dict[str, str]
) -> None:
    """Issue 30 point 5: ``max_staleness: 1`` with its scoring on a shared, multi-tenant server (chunks
    scored as they arrive, batches generated a step ahead)."""
    trainer = trainer_a(nats_server.url, tmp_path / "a", max_staleness=1)
    try:
        results = list(trainer.steps(max_steps=4))
    finally:
        trainer.close()
    rows = metrics(tmp_path / "a")
    assert [r.step for r in results] == [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["train/weight_version"] - row["rollout/weight_version_oldest"] <= 1
        assert row["rollout/staleness_over_bound"] == 0 and 0.0 <= row["reward/mean"] <= 1.0
    assert max(row["rollout/staleness_max"] for row in rows) == 1, "the fleet never generated ahead"
