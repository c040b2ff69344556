"""VLLMEngine on CUDA: sleep levels 1 and 2 (colocated mode) and tensor parallelism (TP=2).

GPU-only: these run where the ``gpu`` extra (CUDA vLLM) and GPUs exist (``uv run --extra gpu
pytest -m gpu tests/rollout``); everywhere else they are skipped. TP=2 needs two GPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from weight_buckets import weight_buckets  # (this folder's helper module)

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines import HFEngine
from rlfleet.rollout.errors import WeightsDiscarded

pytest.importorskip("vllm", reason="vLLM is not installed (uv sync --extra gpu)")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from rlfleet.rollout.engines.vllm import VLLMEngine  # noqa: E402

PROMPTS = [[30, 11, 8, 15], [5, 40, 6], [50, 60, 44, 9, 13, 21]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _publish(engine: VLLMEngine, path: Path, version: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(path)
    for bucket in weight_buckets(model, 20_000):
        engine.load_weights(bucket)
    engine.set_weight_version(version)


def _expected(path: Path) -> list[list[int]]:
    return [c.token_ids for c in HFEngine(path, device="cuda").generate(PROMPTS, GREEDY)]


def _engine(path: Path, **kwargs: object) -> VLLMEngine:
    return VLLMEngine(path, device="cuda", enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.3,
                      **kwargs)  # fmt: skip


@pytest.mark.timeout(600)
def test_sleep_level_1_frees_the_gpu_and_keeps_the_weights(make_vllm_checkpoint) -> None:
    path = make_vllm_checkpoint(seed=0)
    engine = _engine(path, colocate=True, sleep_level=1)
    try:
        awake_free = torch.cuda.mem_get_info()[0]
        first = engine.generate(PROMPTS, GREEDY)  # the engine sleeps after generating
        assert engine.sleeping
        assert torch.cuda.mem_get_info()[0] > awake_free  # KV cache and weights left the GPU
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == [c.token_ids for c in first]
        assert [c.token_ids for c in first] == _expected(path)
        target = make_vllm_checkpoint(seed=1)
        _publish(engine, target, version=1)  # loading wakes it
        assert not engine.sleeping
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == _expected(target)
    finally:
        engine.close()


@pytest.mark.timeout(600)
def test_sleep_level_0_stays_awake_and_loads_in_place(make_vllm_checkpoint) -> None:
    path = make_vllm_checkpoint(seed=0)
    engine = _engine(path, colocate=True, sleep_level=0)
    try:
        held = torch.cuda.mem_get_info()[0]
        first = engine.generate(PROMPTS, GREEDY)
        assert not engine.sleeping
        assert torch.cuda.mem_get_info()[0] <= held + 2**26  # nothing was given back (64 MiB of slack)
        assert [c.token_ids for c in first] == _expected(path)
        target = make_vllm_checkpoint(seed=1)
        _publish(engine, target, version=1)
        assert not engine.sleeping
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == _expected(target)
    finally:
        engine.close()


@pytest.mark.timeout(600)
def test_sleep_level_2_needs_a_full_publish(make_vllm_checkpoint) -> None:
    engine = _engine(make_vllm_checkpoint(seed=0), colocate=True, sleep_level=2)
    try:
        engine.generate(PROMPTS, GREEDY)  # weights from disk; then they are discarded
        assert engine.sleeping
        with pytest.raises(WeightsDiscarded):
            engine.generate(PROMPTS, GREEDY)
        target = make_vllm_checkpoint(seed=1)
        _publish(engine, target, version=1)
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == _expected(target)
    finally:
        engine.close()


@pytest.mark.timeout(900)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")
def test_tensor_parallel_2_matches_hf_and_reloads(make_vllm_checkpoint) -> None:
    path = make_vllm_checkpoint(seed=0)
    engine = _engine(path, tensor_parallel_size=2)
    try:
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == _expected(path)
        target = make_vllm_checkpoint(seed=1)
        _publish(engine, target, version=1)  # every rank takes the full tensors and shards them itself
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == _expected(target)
    finally:
        engine.close()
