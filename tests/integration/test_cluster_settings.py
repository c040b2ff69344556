"""Cluster mode: the job's settings reach standalone workers, and a worker that cannot follow them refuses.

Every tier is started by hand (``rlfleet-<tier> serve``) against a nats-server, as an orchestrator
would, each from its own config. The trainer's own file says learning rate 0.5, clip 0.9 and
micro-batch 1; the job says 0.003, 0.15 and 4. The run joins with ``fleet.nats_url`` and its step
metrics, which the trainer reports, show the job's values. A trainer started with another
sharding and trained layers than the job's refuses to serve the run, naming both fields.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.controller import GRPOTrainer, TrainerConfig
from rlfleet.controller.dataset import PromptDataset
from rlfleet.controller.errors import SettingsConflict

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(
    tmp_path: Path, tiny_model_dir: Path, venv_script, cli_env
) -> Iterator[tuple[str, str, callable]]:
    """A nats-server and a way to start standalone workers on it; stops exactly those workers."""
    name = f"clu-{uuid.uuid4().hex[:6]}"
    started: list[subprocess.Popen[bytes]] = []
    with EmbeddedNats() as nats:

        def start(tier: str, config: dict[str, object]) -> None:
            path = tmp_path / f"{tier}-{len(started)}.yaml"
            path.write_text(yaml.safe_dump({"fleet": {"nats_url": nats.url, "cluster": name}, **config}))
            log = open(tmp_path / f"{tier}-{len(started)}.log", "wb")  # noqa: SIM115 (closed with the process)
            started.append(subprocess.Popen([venv_script(f"rlfleet-{tier}"), "serve", "--config", str(path)],
                                            stdout=log, stderr=subprocess.STDOUT, env=cli_env))  # fmt: skip
            log.close()

        try:
            yield nats.url, name, start
        finally:
            for proc in started:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in started:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()


def _job(url: str, name: str, tmp_path: Path, **overrides: object) -> TrainerConfig:
    settings = dict(
        fleet={"nats_url": url, "cluster": name}, rollout_batch_size=4, train_batch_size=4, group_size=2,
        micro_batch_size=4, max_prompt_length=32, max_response_length=6, learning_rate=0.003, clip_eps=0.15,
        kl_coef=0.0,
        device="cpu", seed=3, output_dir=str(tmp_path / "run"), loggers=["jsonl"], sample_table_size=0,
        reward={"url": url, "cluster": name}, startup_timeout_s=120,
    )  # fmt: skip
    return TrainerConfig(**{**settings, **overrides})


def test_standalone_workers_train_with_the_jobs_settings(
    cluster, tmp_path: Path, tiny_model_dir: Path
) -> None:
    url, name, start = cluster
    model = str(tiny_model_dir)
    start("trainer", {"model_path": model, "placement": {"device": "cpu"}, "worker_id": "trainer-own",
                      "step": {"update": {"learning_rate": 0.5, "clip_eps": 0.9, "micro_batch_size": 1,
                                          "kl_coef": 0.0}}})  # fmt: skip
    start("rollout", {"model_path": model, "placement": {"device": "cpu"}, "worker_id": "rollout-own"})
    start("reward", {"endpoints": {"default": "charset:allowed=0123456789"}, "worker_id": "reward-own"})
    dataset = PromptDataset(str(DATA), max_prompt_length=32, seed=3)
    trainer = GRPOTrainer(model, "charset:allowed=0123456789", dataset, _job(url, name, tmp_path))
    try:
        results = list(trainer.steps(num_epochs=1, max_steps=2))
    finally:
        trainer.close()
    for result in results:
        assert result.metrics["lr"] == pytest.approx(0.003)
        assert result.metrics["settings/clip_eps"] == pytest.approx(0.15)
        assert result.metrics["settings/micro_batch_size"] == 4
    assert trainer.process_ids == []  # a cluster run starts no process of its own


def test_a_trainer_that_cannot_follow_the_job_refuses_it(
    cluster, tmp_path: Path, tiny_model_dir: Path
) -> None:
    url, name, start = cluster
    model = str(tiny_model_dir)
    start("trainer", {"model_path": model, "placement": {"device": "cpu"}, "worker_id": "trainer-odd",
                      "model": {"trainable_layers": 1, "sharding": "none"}})  # fmt: skip
    start("rollout", {"model_path": model, "placement": {"device": "cpu"}, "worker_id": "rollout-own"})
    start("reward", {"endpoints": {"default": "charset:allowed=0123456789"}, "worker_id": "reward-own"})
    dataset = PromptDataset(str(DATA), max_prompt_length=32, seed=3)
    trainer = GRPOTrainer(
        model, "charset:allowed=0123456789", dataset, _job(url, name, tmp_path, model={"sharding": "full"})
    )
    try:
        with pytest.raises(SettingsConflict) as info:
            trainer.start()
    finally:
        trainer.close()
    text = str(info.value)
    assert "trainer-odd" in text and "sharding" in text and "trainable_layers" in text
    assert "'full'" in text and "'none'" in text
