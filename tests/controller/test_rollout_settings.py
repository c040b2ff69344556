"""Rollout engine settings from TrainerConfig to the rollout worker's config: the engine a tagged
union (``hf`` | ``vllm``/``auto`` with vLLM's own keywords), the context cap, the previous release's
flat form (``cache_policy``, ``max_cache_len``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.schema.rollout import HFEngineSettings, RolloutWorkerConfig, VLLMEngineSettings
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.worker_configs import rollout_worker_configs

VLLM = {"type": "vllm", "tensor_parallel_size": 2, "enforce_eager": True, "gpu_memory_utilization": 0.5,
        "colocate": True, "sleep_level": 2, "enable_prefix_caching": False,
        "max_model_len": 1024}  # fmt: skip


def test_vllm_settings_reach_the_worker_as_they_are() -> None:
    cfg = TrainerConfig(rollout={"engine": VLLM, "dtype": "bfloat16"}, seed=0)
    (worker,) = rollout_worker_configs(cfg, Path("/m"), "c")
    assert isinstance(worker, RolloutWorkerConfig)
    # what the engine makes of these: engine_kwargs, tests/rollout/test_vllm_registry.py
    assert worker.rollout == cfg.rollout.settings()
    assert worker.rollout.model_dump()["engine"] == {**VLLM, "max_lora_rank": 0}
    engine = worker.rollout
    assert (engine.dtype, engine.max_batch_size, worker.placement.seed, worker.model_path) == (
        "bfloat16", 64, 0, "/m",
    )  # fmt: skip


@pytest.mark.parametrize(("adapter", "asked", "served"), [(True, 0, 16), (True, 32, 32), (False, 0, 0)])
def test_a_lora_run_that_publishes_its_adapter_starts_vllm_for_its_rank(
    adapter: bool, asked: int, served: int
) -> None:
    cfg = TrainerConfig(rollout={"engine": {**VLLM, "max_lora_rank": asked}}, model={"lora": {"rank": 16}},
                        weight_sync={"adapter": adapter})  # fmt: skip
    (worker,) = rollout_worker_configs(cfg, Path("/m"), "c")
    engine = worker.rollout.vllm()
    assert engine is not None and engine.max_lora_rank == served
    (plain,) = rollout_worker_configs(TrainerConfig(model={"lora": {"rank": 16}}), Path("/m"), "c")
    assert plain.rollout.vllm() is None  # the HF engine applies adapters without a setting


def test_the_previous_flat_form_of_the_rollout_section_loads_with_a_warning() -> None:
    flat = {"engine": "vllm", "tensor_parallel_size": 2, "enforce_eager": True, "gpu_memory_utilization": 0.5,
            "colocate": True, "sleep_level": 2, "cache_policy": "none", "max_cache_len": 1024}  # fmt: skip
    with pytest.warns(FutureWarning, match="cache_policy -> engine.enable_prefix_caching") as caught:
        old = TrainerConfig(rollout=flat)
    assert "max_cache_len -> engine.max_model_len" in " ".join(str(w.message) for w in caught)
    assert old == TrainerConfig(rollout={"engine": VLLM})


def test_defaults_are_hf_and_vllm_s_prefix_caching_and_2048() -> None:
    cfg = TrainerConfig()
    assert cfg.rollout.engine == HFEngineSettings(type="hf") and cfg.rollout.context_cap is None
    vllm = VLLMEngineSettings(type="vllm")
    assert (vllm.enable_prefix_caching, vllm.max_model_len) == (
        True,
        2048,
    ) and vllm.gpu_memory_utilization == "auto"
    assert (vllm.colocate, vllm.enforce_eager, vllm.tensor_parallel_size) == (False, None, 1)
    assert TrainerConfig(rollout={"engine": "vllm"}).rollout.engine == vllm  # the tag alone


def test_prompt_plus_response_must_fit_the_context_cap() -> None:
    with pytest.raises(ValueError, match=r"max_prompt_length \(512\) \+ max_response_length \(128\) exceeds "
                                         r"rollout.engine.max_model_len \(600\)"):  # fmt: skip
        TrainerConfig(rollout={"engine": {"type": "vllm", "max_model_len": 600}})
    TrainerConfig(rollout={"engine": {"type": "vllm", "max_model_len": 640}})
    TrainerConfig(rollout={"engine": "hf"}, max_prompt_length=4096)  # the HF engine has no cap
    short = {"short": {"engine": {"type": "vllm", "max_model_len": 100}}}
    with pytest.raises(ValueError, match=r"rollout.pools.short.engine.max_model_len \(100\)"):
        TrainerConfig(rollout={"pools": short})
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        TrainerConfig(rollout={"engine": {"type": "vllm", "enable_prefix_caching": "fifo"}})
    with pytest.raises(ValueError, match="rollout_cache_policy"):  # the old top-level key is gone
        TrainerConfig(rollout_cache_policy="none")
