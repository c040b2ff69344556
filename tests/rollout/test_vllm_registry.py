"""How the vLLM engine is chosen and configured: lazy registry entry, ``auto``, worker settings, errors."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys

import pytest

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.rollout import RolloutSettings, RolloutWorkerConfig, VLLMEngineSettings
from rlfleet.common.schema.worker import FleetAddress, Placement
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


def _worker(engine: dict[str, object]) -> RolloutWorkerConfig:
    return RolloutWorkerConfig(model_path="/m", fleet=FleetAddress(cluster="c"), placement=Placement(seed=3),
                               rollout=RolloutSettings(engine=engine))  # fmt: skip


def test_worker_settings_map_to_engine_arguments() -> None:
    vllm = {"type": "vllm", "enable_prefix_caching": False, "max_model_len": 512, "tensor_parallel_size": 2,
            "colocate": True, "sleep_level": 2}  # fmt: skip
    common = {"dtype": "float32", "device": "cuda", "seed": 3, "max_batch_size": 64,
              "trust_remote_code": False}  # fmt: skip
    assert engine_kwargs(_worker({"type": "hf"}), "cuda") == common
    assert engine_kwargs(_worker(vllm), "cuda") == {
        **common, "tensor_parallel_size": 2, "gpu_memory_utilization": "auto", "enforce_eager": False,
        "enable_prefix_caching": False, "max_model_len": 512, "colocate": True, "sleep_level": 2,
        "max_lora_rank": 0,
    }  # fmt: skip
    on_cpu = engine_kwargs(_worker({"type": "vllm"}), "cpu")
    assert on_cpu["enable_prefix_caching"] and on_cpu["enforce_eager"] and on_cpu["max_model_len"] == 2048
    assert engine_kwargs(_worker({"type": "vllm", "enforce_eager": False}), "cpu")["enforce_eager"] is False
    auto = engine_kwargs(_worker({"type": "auto", "max_model_len": 512}), "cpu")  # vLLM settings iff vLLM
    assert auto.get("max_model_len") == (512 if vllm_available() else None) and auto["seed"] == 3
    awake = engine_kwargs(_worker({"type": "vllm", "colocate": True, "sleep_level": 0}), "cuda")
    assert awake["colocate"] and awake["sleep_level"] == 0  # a colocated engine that stays awake


def test_sleep_levels_are_0_1_2() -> None:
    assert [VLLMEngineSettings(type="vllm", sleep_level=n).sleep_level for n in (0, 1, 2)] == [0, 1, 2]
    with pytest.raises(ValueError, match="sleep_level"):
        VLLMEngineSettings(type="vllm", sleep_level=3)


def test_the_vllm_section_holds_the_engine_keywords_under_their_own_names() -> None:
    """Every setting of ``engine: {type: vllm}`` is a keyword of VLLMEngine (so none is renamed)."""
    from rlfleet.rollout.engines.vllm.engine import VLLMEngine

    keywords = inspect.signature(VLLMEngine.__init__).parameters
    assert set(VLLMEngineSettings.model_fields) - {"type"} <= set(keywords)
    assert set(engine_kwargs(_worker({"type": "vllm"}), "cpu")) <= set(keywords)


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
        ({"sleep_level": -1}, "sleep_level"),
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
