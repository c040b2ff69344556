"""Rollout engine settings from TrainerConfig to the rollout worker's config (KV-cache policy, vLLM knobs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.worker_configs import rollout_worker_configs


def test_cache_policy_and_vllm_settings_reach_the_worker() -> None:
    rollout = {"engine": "vllm", "tensor_parallel_size": 2, "enforce_eager": True,
               "gpu_memory_utilization": 0.5, "colocate": True, "sleep_level": 2, "cache_policy": "none",
               "max_cache_len": 1024}  # fmt: skip
    cfg = TrainerConfig(rollout=rollout, seed=0)
    (worker,) = rollout_worker_configs(cfg, Path("/m"), "c")
    assert isinstance(worker, RolloutWorkerConfig)
    # what the engine makes of these: engine_kwargs, tests/rollout/test_vllm_registry.py
    assert worker.model_dump(include={*rollout, "seed", "dtype", "max_batch_size", "model_path"}) == {
        **rollout, "seed": 0, "dtype": "float32", "max_batch_size": 64, "model_path": "/m",
    }  # fmt: skip


def test_defaults_are_lru_and_2048() -> None:
    cfg = TrainerConfig()
    assert (cfg.rollout.cache_policy, cfg.rollout.max_cache_len) == ("lru", 2048)
    assert (cfg.rollout.colocate, cfg.rollout.enforce_eager, cfg.rollout.tensor_parallel_size) == (
        False,
        None,
        1,
    )


def test_prompt_plus_response_must_fit_the_cache_cap() -> None:
    with pytest.raises(ValueError, match=r"max_prompt_length \(512\) \+ max_response_length \(128\) exceeds "
                                         r"rollout.max_cache_len \(600\)"):  # fmt: skip
        TrainerConfig(rollout={"max_cache_len": 600})
    TrainerConfig(rollout={"max_cache_len": 640})
    with pytest.raises(ValueError, match=r"rollout_pools.short.max_cache_len \(100\)"):
        TrainerConfig(rollout_pools={"short": {"max_cache_len": 100}})
    with pytest.raises(ValueError, match="cache_policy"):
        TrainerConfig(rollout={"cache_policy": "fifo"})
    with pytest.raises(ValueError, match="rollout_cache_policy"):  # the old top-level key is gone
        TrainerConfig(rollout_cache_policy="none")
