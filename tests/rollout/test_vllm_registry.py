"""How the vLLM engine is chosen and configured: lazy registry entry, ``auto``, worker settings, errors."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.rollout.engines import ENGINES, make_engine
from rlfleet.rollout.engines.registry import resolve_engine_name, vllm_available
from rlfleet.rollout.errors import EngineUnavailable, UnknownEngine
from rlfleet.rollout.service import engine_kwargs


@pytest.mark.timeout(120)
def test_importing_the_rollout_tier_never_imports_vllm() -> None:
    code = (
        "import sys, rlfleet.rollout.engines, rlfleet.rollout.service, rlfleet.rollout.main; "
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True
    )
    assert out.stdout.strip() == "[]"


def test_auto_picks_vllm_exactly_when_it_is_installed() -> None:
    assert vllm_available() is (importlib.util.find_spec("vllm") is not None)
    assert resolve_engine_name("auto") == ("vllm" if vllm_available() else "hf")
    assert resolve_engine_name("hf") == "hf" and resolve_engine_name("vllm") == "vllm"
    assert set(ENGINES) == {"hf", "vllm"} and callable(ENGINES["vllm"])
    with pytest.raises(UnknownEngine, match="registered engines: hf, vllm"):
        make_engine("sglang", "/nowhere")


def test_worker_settings_map_to_engine_arguments() -> None:
    cfg = RolloutWorkerConfig(model_path="/m", cluster="c", seed=3, cache_policy="none", max_cache_len=512,
                               tensor_parallel_size=2, colocate=True, sleep_level=2)  # fmt: skip
    common = {"dtype": "float32", "device": "cuda", "seed": 3, "max_batch_size": 64,
              "trust_remote_code": False}  # fmt: skip
    assert engine_kwargs(cfg, "hf", "cuda") == common
    assert engine_kwargs(cfg, "vllm", "cuda") == {
        **common, "tensor_parallel_size": 2, "gpu_memory_utilization": "auto", "enforce_eager": False,
        "enable_prefix_caching": False, "max_model_len": 512, "colocate": True, "sleep_level": 2,
    }  # fmt: skip
    lru = RolloutWorkerConfig(model_path="/m", cluster="c")
    on_cpu = engine_kwargs(lru, "vllm", "cpu")
    assert on_cpu["enable_prefix_caching"] and on_cpu["enforce_eager"] and on_cpu["max_model_len"] == 2048
    explicit = RolloutWorkerConfig(model_path="/m", cluster="c", enforce_eager=False)
    assert engine_kwargs(explicit, "vllm", "cpu")["enforce_eager"] is False


@pytest.mark.timeout(60)
def test_missing_vllm_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, make_vllm_checkpoint) -> None:
    from rlfleet.rollout.engines.vllm import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now fails as if it were not installed
    with pytest.raises(EngineUnavailable, match=r"vLLM is not installed .*--extra cpu"):
        VLLMEngine(make_vllm_checkpoint())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": "half"}, "gpu_memory_utilization"),
        ({"sleep_level": 3}, "sleep_level"),
        ({"max_model_len": 1}, "max_model_len"),
    ],
)
def test_bad_settings_fail_before_vllm_starts(make_vllm_checkpoint, kwargs: dict, field: str) -> None:
    from rlfleet.rollout.engines.vllm import VLLMEngine

    with pytest.raises(ConfigError, match=field):
        VLLMEngine(make_vllm_checkpoint(), **kwargs)


@pytest.mark.timeout(120)
def test_the_cpu_build_refuses_cuda(make_vllm_checkpoint) -> None:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (uv sync --extra cpu)")
    from vllm.platforms import current_platform

    from rlfleet.rollout.engines.vllm import VLLMEngine

    if not current_platform.is_cpu():
        pytest.skip("the installed vLLM is not the CPU build")
    assert vllm.__version__
    with pytest.raises(EngineUnavailable, match="runs on 'cpu', the engine asked for 'cuda'"):
        VLLMEngine(make_vllm_checkpoint(), device="cuda")
