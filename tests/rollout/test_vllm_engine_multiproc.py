"""VLLMEngine with vLLM's engine core in its own process (the CUDA default), exercised on CPU.

Weight buckets then cross a process boundary as safetensors bytes through ``collective_rpc``:
the path every GPU deployment takes. Slow (the engine-core process starts in ~20 s).
"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM
from weight_buckets import weight_buckets  # (this folder's helper module)

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines import HFEngine

vllm_envs = pytest.importorskip("vllm.envs", reason="vLLM is not installed (uv sync --extra cpu)")

from rlfleet.rollout.engines.vllm import VLLMEngine  # noqa: E402

PROMPTS = [[30, 11, 8, 15], [5, 40, 6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_buckets_cross_into_a_separate_engine_process(
    monkeypatch: pytest.MonkeyPatch, make_vllm_checkpoint
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    vllm_envs.disable_envs_cache()  # an earlier in-process engine froze vLLM's view of the environment
    engine = VLLMEngine(make_vllm_checkpoint(seed=0, tie=True), enforce_eager=True, max_model_len=64)
    try:
        assert not engine._in_process
        target = make_vllm_checkpoint(seed=1, tie=True)
        for bucket in weight_buckets(AutoModelForCausalLM.from_pretrained(target), 20_000):
            engine.load_weights(bucket)
        engine.set_weight_version(1)
        ours, theirs = engine.generate(PROMPTS, GREEDY), HFEngine(target).generate(PROMPTS, GREEDY)
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    finally:
        engine.close()
        vllm_envs.disable_envs_cache()
