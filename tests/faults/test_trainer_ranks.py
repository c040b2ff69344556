"""Trainer ranks that fail or die (issue 12, point 6): named at once, nobody waits in a collective.

Two real gloo ranks on CPU behind one NATS worker, started as the embedded launcher starts them
(``TwoRanks`` of tests/integration/test_trainer_ranks.py), and a tiny GRPO run of two ranks:

- a command only rank 1 cannot do before its first collective (a full checkpoint whose rank-1 RNG
  state is gone) is answered with an error naming rank 1 and why; both ranks live on and the next
  step trains;
- rank 1 killed with SIGKILL under an idle trainer: the next step is answered within 60 s with
  ``TrainerRankDied`` naming rank 1, and rank 0 exits with ``RANK_LOST_EXIT`` (no 20-minute wait in
  a collective);
- rank 0 failing a publish after its first gather (its weight store full): answered with
  ``RanksOutOfStep``, rank 0 exits, and the follower left in the next gather exits naming rank 0;
- rank 1 killed in a run with ``save_every``: the run restores the trainer's ranks from the last
  checkpoint and finishes, saying which rank died.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rlfleet.common.control.messages import (
    LoadCheckpoint,
    PublishWeights,
    SaveCheckpoint,
    Saved,
    TrainStepRequest,
    TrainStepResult,
)
from rlfleet.common.errors import RemoteError
from rlfleet.common.schema.trainer import BatchSettings, StepSettings, UpdateSettings
from rlfleet.trainer.rank_liveness import RANK_LOST_EXIT


def _module(path: Path, name: str) -> ModuleType:
    """Another test file's helpers (the tests run with importlib imports: no test dir on sys.path)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TESTS = Path(__file__).resolve().parents[1]
_two_ranks = _module(TESTS / "integration" / "test_trainer_ranks.py", "rlfleet_two_ranks")
TwoRanks, rollouts = _two_ranks.TwoRanks, _two_ranks._rollouts
_trainer = _module(TESTS / "faults" / "test_trainer_restart.py", "rlfleet_trainer_restart")._trainer

SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5]
STEP = StepSettings(update=UpdateSettings(learning_rate=2e-3, micro_batch_size=2, kl_coef=0.0),
                    batch=BatchSettings(rollout_batch_size=3, train_batch_size=1))  # fmt: skip


def _settings(model_dir: Path) -> dict[str, object]:
    return _two_ranks.worker_settings(model_dir, kl_coef=0.0)


def _step(ranks: object, step: int) -> TrainStepRequest:
    return TrainStepRequest(step=step, rollouts=[ranks.ref], scores=SCORES, settings=STEP)  # type: ignore[attr-defined]


@pytest.fixture
async def ranks(tmp_path: Path, tiny_model_dir: Path, procs) -> AsyncIterator[object]:
    """Two trainer ranks that trained step 1; on leaving, every rank process is gone."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    async with TwoRanks(tmp_path / "fleet", _settings(tiny_model_dir), rollouts(vocab)) as two:
        assert isinstance(await two.ask("step", _step(two, 1)), TrainStepResult)
        yield two
    assert procs.survivors(two.pids) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_an_error_on_rank_1_only_is_answered_naming_it_and_both_ranks_serve_on(
    tmp_path: Path, ranks: Any
) -> None:
    saved_at = tmp_path / "full"
    assert isinstance(await ranks.ask("save", SaveCheckpoint(path=str(saved_at), mode="full")), Saved)
    # damaged on rank 1's side only: rank 0 finds all it reads, rank 1 not its RNG state
    (saved_at / "trainer" / "rng-1.json").unlink()
    with pytest.raises(RemoteError) as refused:
        await ranks.ask("load", LoadCheckpoint(path=str(saved_at), weight_version=1))
    message = refused.value.remote_message
    named = f"TrainerRankFailed: trainer rank 1 could not load checkpoint '{saved_at}': CheckpointError: "
    assert message.startswith(named), message
    assert "lacks rng-1.json (read by trainer rank 1)" in message, message
    assert refused.value.code == "bad_request" and not refused.value.retryable
    ranks.fleet.check()  # both ranks still run
    result = await ranks.ask("step", _step(ranks, 2))  # and every rank is in step with the others
    assert isinstance(result, TrainStepResult) and result.metrics["num_optimizer_steps"] > 0
    ranks.fleet.check()


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_killed_rank_1_is_named_within_60_s_and_rank_0_exits(ranks: Any) -> None:
    rank0 = ranks.fleet.workers[0].process
    os.kill(ranks.pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as died:
        await ranks.ask("step", _step(ranks, 2))
    assert time.monotonic() - t0 < 60
    message = died.value.remote_message
    assert message.startswith("TrainerRankDied: trainer rank 1 stopped answering "), message
    assert "rank 0 exits so that the trainer's ranks restart together" in message
    assert rank0.wait(timeout=30) == RANK_LOST_EXIT
    assert time.monotonic() - t0 < 60
    assert "TrainerRankDied: trainer rank 1 stopped answering" in ranks.fleet.workers[0].log_tail(20)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_rank_0_failing_after_the_first_collective_answers_and_exits(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    """Its weight store (a few KiB) fills during a publish, between two gathers: the follower waits in
    the next gather, so rank 0 answers RanksOutOfStep and exits, and the follower, finding rank 0
    gone, exits too: nobody hangs."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    settings = {**_settings(tiny_model_dir), "weights_store_mb": 0.004}
    async with TwoRanks(tmp_path / "fleet", settings, rollouts(vocab)) as ranks:
        assert isinstance(await ranks.ask("step", _step(ranks, 1)), TrainStepResult)  # both ranks up
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as failed:
            await ranks.ask("publish", PublishWeights(weight_version=1, bucket_mb=0.002))
        message = failed.value.remote_message
        named = "RanksOutOfStep: trainer rank 0 failed in publish (publish weight version 1) after the first "
        assert message.startswith(named + "collective (StoreFull: "), message
        rank0, follower = (worker.process for worker in ranks.fleet.workers)
        assert rank0.wait(timeout=30) == RANK_LOST_EXIT
        # the follower, left in a gather, finds rank 0 gone: it exits too, naming it
        assert follower.wait(timeout=60) == RANK_LOST_EXIT
        assert time.monotonic() - t0 < 60, time.monotonic() - t0
        tail = ranks.fleet.workers[1].log_tail(20)
        assert "TrainerRankDied: trainer rank 0 " in tail and "rank 1 exits" in tail, tail
    assert procs.survivors(ranks.pids) == []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_killed_rank_1_in_a_run_is_restored_from_the_last_checkpoint(
    tmp_path: Path, tiny_model_dir: Path, procs, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    trainer = _trainer(tiny_model_dir, out, save_every=2, num_train_workers=2)
    try:
        steps = trainer.steps(num_epochs=3, max_steps=4)
        results = [next(steps) for _ in range(3)]
        before = procs.launched(out)
        os.kill(before["trainer-0-rank1"], signal.SIGKILL)  # step 3 answered, checkpoint-2 the latest
        t0 = time.monotonic()
        results.append(next(steps))
        assert time.monotonic() - t0 < 120  # the kill was seen at once (restart and reload included)
        results += list(steps)
        after = procs.launched(out)
    finally:
        trainer.close()
    assert [r.step for r in results] == [1, 2, 3, 3, 4]
    said = capsys.readouterr().out
    assert "the trainer was restored from checkpoint-2 after: trainer worker trainer-0-rank1 was killed by " \
           "signal SIGKILL" in said, said[-2000:]  # fmt: skip
    assert after["trainer-0"] != before["trainer-0"] and after["trainer-0-rank1"] != before["trainer-0-rank1"]
    assert procs.survivors({**before, **after}) == []
