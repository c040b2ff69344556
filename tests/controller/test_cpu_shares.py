"""A pipelined run on CPU gives the trainer and the rollout workers their own shares of the cores
(``OMP_NUM_THREADS`` per worker); a synchronous run, a CUDA run, or the user's own setting is left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.cpu_shares import THREADS_ENV, cpu_thread_env
from rlfleet.controller.worker_configs import worker_specs

TIERS = ["trainer", "reward", "rollout"]


@pytest.fixture(autouse=True)
def _no_user_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREADS_ENV, raising=False)


def test_two_cores_one_for_the_trainer_one_for_the_rollout_worker() -> None:
    env = cpu_thread_env(TIERS, device="cpu", max_staleness=1, cores=2)
    assert env == [{THREADS_ENV: "1"}, {THREADS_ENV: "1"}, {THREADS_ENV: "1"}]


def test_the_halves_are_split_among_ranks_and_workers() -> None:
    tiers = ["trainer", "trainer", "reward", "rollout", "rollout", "rollout"]
    env = cpu_thread_env(tiers, device="auto", max_staleness=2, cores=16)
    assert [e[THREADS_ENV] for e in env] == ["4", "4", "1", "2", "2", "2"]


def test_left_alone_when_synchronous_on_cuda_or_set_by_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_thread_env(TIERS, device="cpu", max_staleness=0, cores=8) == [{}, {}, {}]
    assert cpu_thread_env(TIERS, device="cuda", max_staleness=1, cores=8) == [{}, {}, {}]
    monkeypatch.setenv(THREADS_ENV, "3")
    assert cpu_thread_env(TIERS, device="cpu", max_staleness=1, cores=8) == [{}, {}, {}]


def test_an_embedded_pipelined_run_starts_its_workers_with_their_shares() -> None:
    cfg = TrainerConfig(max_staleness=1, device="cpu", rollout={"workers": 2})
    specs = worker_specs(cfg, Path("/models/m"), "c1", online=True, reward_spec="numeric")
    assert all(THREADS_ENV in s.env for s in specs)
    synchronous = worker_specs(TrainerConfig(device="cpu"), Path("/models/m"), "c1", online=True,
                               reward_spec="numeric")  # fmt: skip
    assert not any(THREADS_ENV in s.env for s in synchronous)
