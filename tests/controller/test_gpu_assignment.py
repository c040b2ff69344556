"""The embedded launcher's GPU assignment: disjoint layouts, colocated pools, too few GPUs, CPU-only."""

from __future__ import annotations

import pytest

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.reward import RewardWorkerConfig
from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.gpu_assignment import (
    GpuAssignment,
    assignment_for,
    plan_gpus,
    reward_gpu_count,
    visible_gpus,
)
from rlfleet.controller.launcher_settings import EmbeddedLauncher


def _rollout(pool: str = "default", tp: int = 1) -> RolloutWorkerConfig:
    engine = {"type": "vllm", "tensor_parallel_size": tp}
    rollout = {"engine": engine}
    return RolloutWorkerConfig(
        fleet={"cluster": "c"}, worker_id="r", model_path="m", pool=pool, rollout=rollout
    )


def _ranks(n: int) -> list[dict[str, str]]:
    return [{"RANK": str(r), "WORLD_SIZE": str(n)} for r in range(n)] if n > 1 else [{}]


def _place(
    assignment: GpuAssignment, workers: list[tuple[str, str, object, dict[str, str]]]
) -> dict[str, str]:
    """Each worker's CUDA_VISIBLE_DEVICES, started in order as the launcher starts them."""
    live: list[str] = []
    out = {}
    for tier, worker_id, config, env in workers:
        out[worker_id] = assignment.env_for(tier, worker_id, config, env, live)["CUDA_VISIBLE_DEVICES"]
        live.append(worker_id)
    return out


@pytest.mark.timeout(30)
def test_disjoint_trainer_then_rollout_then_reward() -> None:
    layout = plan_gpus([str(g) for g in range(8)], 2, {"default": (2, 2, False)})
    assert layout.trainer == [["0"], ["1"]] and layout.pools["default"] == [["2", "3"], ["4", "5"]]
    reward = {"endpoints": {"default": "reward_model:path=/m,device=cuda"}}
    placed = _place(GpuAssignment(layout), [
        ("trainer", "trainer-0", {}, _ranks(2)[0]), ("trainer", "trainer-0-rank1", {}, _ranks(2)[1]),
        ("reward", "reward-0", reward, {}),  # started before the rollout workers, placed after them
        ("rollout", "rollout-0", _rollout(tp=2), {}), ("rollout", "rollout-1", _rollout(tp=2), {}),
    ])  # fmt: skip
    assert placed == {"trainer-0": "0", "trainer-0-rank1": "1", "reward-0": "6", "rollout-0": "2,3",
                      "rollout-1": "4,5"}  # fmt: skip


@pytest.mark.timeout(30)
def test_pools_keep_their_slots_and_reward_without_cuda_gets_no_gpu() -> None:
    layout = plan_gpus(["a", "b", "c", "d"], 1, {"small": (1, 1, False), "big": (1, 2, False)})
    placed = _place(GpuAssignment(layout), [
        ("trainer", "trainer-0", {}, {}), ("reward", "reward-0", {"endpoints": {"d": "concise"}}, {}),
        ("rollout", "rollout-big-0", _rollout("big", 2), {}),
        ("rollout", "rollout-small-0", _rollout("small"), {}),
    ])  # fmt: skip
    assert placed == {"trainer-0": "a", "reward-0": "", "rollout-big-0": "c,d", "rollout-small-0": "b"}


@pytest.mark.timeout(30)
def test_colocated_pool_shares_the_trainer_gpus() -> None:
    layout = plan_gpus(["0", "1"], 2, {"default": (3, 1, True)})
    assert layout.pools["default"] == [["0"], ["1"], ["0"]] and layout.spare == []
    reward = {"endpoints": {"x": {"components": [{"name": "reward_model", "args": {"device": "cuda"}}]}}}
    placed = _place(GpuAssignment(layout), [
        ("trainer", "trainer-0", {}, _ranks(2)[0]), ("trainer", "trainer-0-rank1", {}, _ranks(2)[1]),
        ("rollout", "rollout-0", _rollout(), {}), ("rollout", "rollout-1", _rollout(), {}),
        ("rollout", "rollout-2", _rollout(), {}), ("reward", "reward-0", reward, {}),
    ])  # fmt: skip
    assert [placed[f"rollout-{i}"] for i in range(3)] == ["0", "1", "0"]
    assert placed["reward-0"] == "0"  # no spare GPU: a colocated run shares the trainer's


@pytest.mark.timeout(30)
def test_too_few_gpus_names_what_is_needed() -> None:
    with pytest.raises(
        ConfigError, match=r"5 GPUs needed .*trainer 2 .*rollout pool default 3 .*4 available"
    ):
        plan_gpus(["0", "1", "2", "3"], 2, {"default": (3, 1, False)})
    with pytest.raises(ConfigError, match="shards over more GPUs than the trainer's 1"):
        plan_gpus(["0", "1"], 1, {"default": (1, 2, True)})
    layout = plan_gpus(["0", "1"], 1, {"default": (1, 1, False)})  # fits, but the reward asks for a GPU too
    with pytest.raises(ConfigError, match="reward-0 needs 1 GPU"):
        _place(
            GpuAssignment(layout),
            [("reward", "reward-0", {"endpoints": {"d": "reward_model:device=cuda"}}, {})],
        )


@pytest.mark.timeout(30)
def test_restart_keeps_gpus_and_a_scaled_worker_takes_a_spare_or_fails() -> None:
    assignment = GpuAssignment(plan_gpus(["0", "1", "2"], 1, {"default": (1, 1, False)}))
    first = _place(assignment, [("trainer", "trainer-0", {}, {}), ("rollout", "rollout-0", _rollout(), {})])
    live = ["trainer-0", "rollout-0"]
    again = assignment.env_for("rollout", "rollout-0", _rollout(), {}, live)["CUDA_VISIBLE_DEVICES"]
    assert first["rollout-0"] == again == "1"
    assert assignment.env_for("rollout", "rollout-1", _rollout(), {}, live)["CUDA_VISIBLE_DEVICES"] == "2"
    with pytest.raises(ConfigError, match="rollout-2 needs 1 GPU"):
        assignment.env_for("rollout", "rollout-2", _rollout(), {}, [*live, "rollout-1"])
    # rollout-1 gone (scaled down): its GPU is free again
    assert assignment.env_for("rollout", "rollout-2", _rollout(), {}, live)["CUDA_VISIBLE_DEVICES"] == "2"


@pytest.mark.timeout(30)
def test_visible_gpus_and_cpu_only() -> None:
    assert visible_gpus(None, "auto", {"CUDA_VISIBLE_DEVICES": "3,5"}) == ["3", "5"]
    assert visible_gpus(1, "auto", {"CUDA_VISIBLE_DEVICES": "3,5"}) == ["3"]
    assert visible_gpus(2, "cpu", {}) == ["0", "1"]
    assert visible_gpus([4, "GPU-x"], "cpu", {}) == ["4", "GPU-x"]
    assert visible_gpus(None, "cpu", {"CUDA_VISIBLE_DEVICES": "0"}) is None  # device cpu: nothing placed
    assert visible_gpus(None, "auto", {"CUDA_VISIBLE_DEVICES": ""}) is None
    with pytest.raises(ConfigError, match="only 2 GPU"):
        visible_gpus(3, "auto", {"CUDA_VISIBLE_DEVICES": "3,5"})
    # this machine has no GPU: a job without a gpus setting places nothing
    assert assignment_for(TrainerConfig(), {}) is None
    hidden = assignment_for(TrainerConfig(launcher={"gpus": 0}), {})
    assert hidden is not None and hidden.env_for("trainer", "trainer-0", {}, {}, []) == {
        "CUDA_VISIBLE_DEVICES": ""
    }
    assert reward_gpu_count({"endpoints": {"a": "reward_model:device=cuda:1 + concise"}}) == 2
    assert reward_gpu_count({"endpoints": {"a": "reward_model:device=cpu"}}) == 0
    on_cuda = {"components": [{"name": "reward_model", "args": {"device": "cuda"}}]}  # a spec's dict form
    assert reward_gpu_count(RewardWorkerConfig(endpoints={"a": on_cuda})) == 1  # the run's own reward worker
    assert reward_gpu_count(RewardWorkerConfig(endpoints={"a": "concise"})) == 0


@pytest.mark.timeout(30)
def test_gpus_setting_is_for_the_embedded_launcher() -> None:
    with pytest.raises(ValueError, match=r"launcher\.ray\.gpus\n  Extra inputs are not permitted"):
        TrainerConfig(launcher={"type": "ray", "gpus": [0, 1]})  # Ray places by its own resources
    assert TrainerConfig(launcher={"gpus": [0, 1]}).launcher == EmbeddedLauncher(type="embedded", gpus=[0, 1])
