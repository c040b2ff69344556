"""A rollout worker killed after it answered its chunk (issue 12, point 2): the chunk is generated again.

Cluster mode first, every tier a real ``rlfleet-<tier> serve`` process, two rollout workers that each
generate one chunk of a step's 4 prompts. The reward is a user function (written to ``tmp_path``,
imported by the reward worker) that, while a hold file exists, waits on its first sample: so the
kill lands at a known point, after the reward tier fetched both chunks' texts and before the
trainer fetched anything. It also logs every sample it scores.

- Step 2: a rollout worker is SIGKILLed and the reward released at once; the trainer cannot fetch
  that worker's chunk (its store is gone), the chunk is generated again on the survivor with the
  same prompts and seed, scored, and the step trained.
- Step 3 (a new rollout worker joined): the worker is SIGKILLed and the reward released only
  after the controller's registry declared it dead; the chunk is generated again before the
  train request goes out.

- The embedded default (the launcher's own processes): a rollout worker is SIGKILLed while the reward
  holds; the launcher restarts it, the run forgets the dead process, and the chunk is generated
  again in the same step (the supervisor does not run the step again).

Each time: the step completes, its trained chunks answer the 4 prompts exactly once (8 samples),
exactly the lost chunk's prompts were generated (and scored) again, with the same samples (same
seed and weights), and the run finishes.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.controller import GRPOTrainer, TrainerConfig
from rlfleet.controller.dataset import PromptDataset
from rlfleet.controller.fault_settings import FaultSettings

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
REWARD = "lost_batch_reward:score"
BATCH, GROUP = 4, 2

REWARD_MODULE = '''
"""Scores digits; waits on the first sample while the hold file exists; logs every sample."""
import json, os, pathlib, threading, time

def score(prompt, response, **metadata):
    root = pathlib.Path(os.environ["LOST_BATCH_DIR"])
    hold = root / "hold"
    if hold.exists() and not (root / f"held-{threading.get_ident()}").exists():
        (root / f"held-{threading.get_ident()}").touch()
        deadline = time.monotonic() + 180
        while hold.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    with open(root / "scored.jsonl", "a") as log:
        log.write(json.dumps({"prompt": prompt, "response": response}) + "\\n")
    return sum(c.isdigit() for c in response) / max(len(response), 1)
'''

pytestmark = pytest.mark.slow

Starter = Callable[..., subprocess.Popen[bytes]]


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _samples(box: Path) -> list[tuple[str, str]]:
    """``(prompt, response)`` of each sample the reward scored since the log was last cleared."""
    path = box / "scored.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(row["prompt"], row["response"]) for row in map(json.loads, lines)]


def _scored(box: Path) -> collections.Counter[str]:
    """Samples the reward scored since the log was last cleared, by prompt."""
    return collections.Counter(prompt for prompt, _ in _samples(box))


def _held(box: Path) -> int:
    return len(list(box.glob("held-*")))


def _reset(box: Path) -> None:
    for path in [*box.glob("held-*"), box / "scored.jsonl"]:
        path.unlink(missing_ok=True)


def _step_with_a_kill(
    steps: Iterator[Any], box: Path, victim: subprocess.Popen[bytes], then: Callable[[], None]
) -> Any:
    """Run the next step; while the reward holds both chunks, SIGKILL ``victim``, ``then()``, release."""
    _reset(box)
    (box / "hold").touch()
    got: dict[str, Any] = {}

    def step() -> None:
        try:
            got["step"] = next(steps)
        except BaseException as exc:  # reported by the test thread
            got["error"] = exc

    thread = threading.Thread(target=step, name="lost-batch-step")
    thread.start()
    try:
        _wait(lambda: _held(box) >= 2 or not thread.is_alive(), 180, "the reward to hold both chunks")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        then()
    finally:
        (box / "hold").unlink(missing_ok=True)
        thread.join(300)
    assert not thread.is_alive(), "the step did not finish"
    if "error" in got:
        raise got["error"]
    return got["step"]


def _check_once(trainer: GRPOTrainer, result: Any, box: Path, killed: str | None) -> None:
    """The step trained every prompt once, and generated again exactly the lost chunk's prompts."""
    rollout = trainer.online_step.last_rollout
    assert rollout is not None
    metrics = result.metrics
    assert metrics["rollout/prompts"] == BATCH and metrics["rollout/samples"] == BATCH * GROUP
    assert metrics["rollout/chunks_regenerated"] == 1.0
    assert len({it.index for it in rollout.items}) == BATCH == len(rollout.items)
    assert sum(r.num_prompts for r in rollout.results) == BATCH
    assert sum(r.num_samples for r in rollout.results) == BATCH * GROUP
    if killed is not None:  # (embedded: a worker restarted under the killed one's id may make chunks)
        assert killed not in {r.worker_id for r in rollout.results}, "a chunk of the dead worker was trained"
    assert len(rollout.results) == 2 and len({r.ref.key for r in rollout.results}) == 2
    per_prompt = _scored(box)
    assert len(per_prompt) == BATCH, per_prompt  # every prompt of the step was scored
    regenerated = sorted(p for p, n in per_prompt.items() if n == 2 * GROUP)
    assert sorted(per_prompt.values()) == [GROUP] * 2 + [2 * GROUP] * 2, per_prompt  # one chunk again
    assert len(regenerated) == 2
    again = collections.Counter(sample for sample in _samples(box) if sample[0] in regenerated)
    assert all(n % 2 == 0 for n in again.values()), f"same prompts, seed and weights, other samples: {again}"


@pytest.mark.timeout(900)
def test_a_chunk_lost_with_its_rollout_worker_is_generated_again(
    serve_tier: Starter, tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO)
    box = tmp_path / "box"
    box.mkdir()
    (tmp_path / "lost_batch_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cluster = f"lost-{uuid.uuid4().hex[:6]}"
    model = str(tiny_model_dir)
    common = {"fleet": {"cluster": cluster}, "heartbeat_s": 1.0}
    rollout = {**common, "model_path": model, "placement": {"device": "cpu"}}
    with EmbeddedNats(jetstream=False) as nats:
        url = nats.url
        serve_tier("trainer", url, {**rollout, "worker_id": "trainer-0"})
        rollouts = {f"rollout-{i}": serve_tier("rollout", url, {**rollout, "worker_id": f"rollout-{i}"})
                    for i in (0, 1)}  # fmt: skip
        env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "LOST_BATCH_DIR": str(box)}  # fmt: skip
        serve_tier("reward", url, {**common, "endpoints": {"default": REWARD}, "worker_id": "reward-0"}, env)
        config = TrainerConfig(
            fleet={"nats_url": url, "cluster": cluster}, reward={"url": url, "cluster": cluster},
            rollout={"workers": 2}, rollout_batch_size=BATCH, train_batch_size=BATCH, group_size=GROUP,
            micro_batch_size=BATCH,
            max_prompt_length=32, max_response_length=6, kl_coef=0.0, device="cpu", seed=3,
            output_dir=str(tmp_path / "run"), loggers=["jsonl"], sample_table_size=0, startup_timeout_s=240,
            faults=FaultSettings(dead_after_s=6.0, retry_backoff_s=0.3),
        )  # fmt: skip
        dataset = PromptDataset(str(DATA), max_prompt_length=32, seed=3)
        trainer = GRPOTrainer(model, REWARD, dataset, config)
        try:
            steps = trainer.steps(num_epochs=1, max_steps=3)
            first = next(steps)
            assert {r.worker_id for r in trainer.online_step.last_rollout.results} == set(rollouts)
            # step 2: killed and released at once; the trainer finds the chunk's store gone
            second = _step_with_a_kill(steps, box, rollouts["rollout-1"], lambda: None)
            _check_once(trainer, second, box, "rollout-1")
            # a new worker joins at the current weights; step 3: released once the registry reaped it
            rollouts["rollout-2"] = serve_tier("rollout", url, {**rollout, "worker_id": "rollout-2"})
            fleet, version = trainer.fleet, trainer.weight_version

            async def both_current() -> None:
                while len(fleet.rollout_workers(weight_version=version)) < 2:
                    await asyncio.sleep(0.2)

            trainer.fleet_run.loop.run(both_current())

            def reaped() -> None:
                _wait(lambda: fleet.registry.get("rollout", "rollout-2") is None, 60, "rollout-2 reaped")

            third = _step_with_a_kill(steps, box, rollouts["rollout-2"], reaped)
            _check_once(trainer, third, box, "rollout-2")
            assert list(steps) == [], "the run finished after its 3 steps"
        finally:
            trainer.close()
    assert [first.step, second.step, third.step] == [1, 2, 3]
    lost = [r.getMessage() for r in caplog.records if "is lost (" in r.getMessage()]
    assert len(lost) == 2, lost
    assert "unreachable" in lost[0], lost[0]  # step 2: the trainer's fetch failed on the dead store
    assert "its worker is gone" in lost[1], lost[1]  # step 3: seen gone before the train request


@pytest.mark.timeout(600)
def test_embedded_a_chunk_lost_with_its_crashed_rollout_worker_is_generated_again(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded default: the launcher restarts the killed worker, the run forgets its process at
    once, and the chunk it held is generated again in the same step (no step run again)."""
    caplog.set_level(logging.INFO)
    box = tmp_path / "box"
    box.mkdir()
    (tmp_path / "lost_batch_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("LOST_BATCH_DIR", str(box))  # the embedded workers inherit the environment
    config = TrainerConfig(
        rollout={"workers": 2}, rollout_batch_size=BATCH, train_batch_size=BATCH, group_size=GROUP,
        micro_batch_size=BATCH, max_prompt_length=32, max_response_length=6, kl_coef=0.0, device="cpu",
        seed=3, output_dir=str(tmp_path / "run"), loggers=["jsonl"], sample_table_size=0,
        startup_timeout_s=240,
    )  # fmt: skip
    dataset = PromptDataset(str(DATA), max_prompt_length=32, seed=3)
    trainer = GRPOTrainer(str(tiny_model_dir), REWARD, dataset, config)
    try:
        steps = trainer.steps(num_epochs=1, max_steps=2)
        first = next(steps)
        launcher, fleet = trainer.fleet_run.launcher, trainer.fleet
        assert launcher is not None
        [victim] = [w for w in launcher.workers if w.spec.worker_id == "rollout-1"]
        before = fleet.registry.get("rollout", "rollout-1")
        assert before is not None

        def forgotten() -> None:  # the run saw the crash: its process is gone from the registry
            def gone() -> bool:
                info = fleet.registry.get("rollout", "rollout-1")
                return info is None or info.announce.incarnation != before.announce.incarnation

            _wait(gone, 60, "the crashed rollout-1 forgotten")

        second = _step_with_a_kill(steps, box, victim.process, forgotten)
        _check_once(trainer, second, box, None)
        assert list(steps) == [], "the run finished after its 2 steps"
    finally:
        trainer.close()
    assert [first.step, second.step] == [1, 2]
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "running it again" in m], "the step was run again"
    assert len([m for m in messages if "is lost (" in m]) == 1


@pytest.mark.timeout(600)
def test_a_chunk_dropped_by_its_live_lone_worker_is_generated_again_there(
    serve_tier: Starter, tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The chunk is gone but its worker lives (it dropped it: here its ``store_ttl_s`` passed while
    the reward held): with no other worker in the pool, the same worker generates it again at once,
    instead of the step waiting ``faults.empty_pool_wait_s`` for another."""
    caplog.set_level(logging.INFO)
    box = tmp_path / "box"
    box.mkdir()
    (tmp_path / "lost_batch_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cluster = f"dropped-{uuid.uuid4().hex[:6]}"
    model = str(tiny_model_dir)
    common = {"fleet": {"cluster": cluster}, "heartbeat_s": 1.0}
    worker = {**common, "model_path": model, "placement": {"device": "cpu"}}
    with EmbeddedNats(jetstream=False) as nats:
        url = nats.url
        serve_tier("trainer", url, {**worker, "worker_id": "trainer-0"})
        serve_tier("rollout", url, {**worker, "worker_id": "rollout-0", "store_ttl_s": 3.0})
        env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "LOST_BATCH_DIR": str(box)}  # fmt: skip
        serve_tier("reward", url, {**common, "endpoints": {"default": REWARD}, "worker_id": "reward-0"}, env)
        config = TrainerConfig(
            fleet={"nats_url": url, "cluster": cluster}, reward={"url": url, "cluster": cluster},
            rollout_batch_size=BATCH, train_batch_size=BATCH, group_size=GROUP, micro_batch_size=BATCH,
            max_prompt_length=32, max_response_length=6, kl_coef=0.0, device="cpu", seed=3,
            output_dir=str(tmp_path / "run"), loggers=["jsonl"], sample_table_size=0, startup_timeout_s=240,
            faults=FaultSettings(retry_backoff_s=0.3, empty_pool_wait_s=120.0),
        )  # fmt: skip
        trainer = GRPOTrainer(model, REWARD, PromptDataset(str(DATA), max_prompt_length=32, seed=3), config)
        try:
            steps = trainer.steps(num_epochs=1, max_steps=2)
            next(steps)
            _reset(box)
            (box / "hold").touch()
            got: dict[str, Any] = {}
            thread = threading.Thread(target=lambda: got.update(step=next(steps)), name="dropped-step")
            thread.start()
            _wait(lambda: _held(box) >= 1, 120, "the reward to hold the chunk")
            time.sleep(6.0)  # past the chunk's TTL: the worker drops it
            (box / "hold").unlink()
            released = time.monotonic()
            thread.join(300)
            took = time.monotonic() - released
        finally:
            (box / "hold").unlink(missing_ok=True)
            trainer.close()
    assert "step" in got, "the step failed"
    assert got["step"].metrics["rollout/chunks_regenerated"] >= 1.0
    assert took < 60, f"the step waited {took:.0f} s for another worker"
    lost = [r.getMessage() for r in caplog.records if "is lost (" in r.getMessage()]
    assert lost, "the dropped chunk was never found lost"
