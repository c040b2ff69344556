"""VLLMEngine settings on CPU: KV-cache policy (prefix caching on / off), untied heads, colocated mode.

Runs where vLLM is installed (``uv run --extra cpu pytest``); skipped otherwise. Two engines, one
after the other (a module-scoped fixture parametrized over the settings).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM
from weight_buckets import weight_buckets  # (this folder's helper module)

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines import HFEngine

pytest.importorskip("vllm", reason="vLLM is not installed (uv sync --extra cpu)")

from rlfleet.rollout.engines.vllm import VLLMEngine  # noqa: E402

LONG = [[5 + (i * 7) % 60 for i in range(150)], [9 + (i * 5) % 50 for i in range(140)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SETTINGS = {
    "lru-tied": {"enable_prefix_caching": True, "tie": True, "colocate": False},
    "none-untied-colocated": {"enable_prefix_caching": False, "tie": False, "colocate": True},
}


@pytest.fixture(scope="module", params=list(SETTINGS))
def setting(request: pytest.FixtureRequest, make_vllm_checkpoint) -> Iterator[tuple[dict, VLLMEngine]]:
    spec = SETTINGS[request.param]
    engine = VLLMEngine(
        make_vllm_checkpoint(seed=0, tie=spec["tie"]), enforce_eager=True, max_model_len=192,
        enable_prefix_caching=spec["enable_prefix_caching"], colocate=spec["colocate"],
    )  # fmt: skip
    yield spec, engine
    engine.close()


@pytest.mark.timeout(180)
def test_prefix_cache_follows_the_policy(setting: tuple[dict, VLLMEngine], make_vllm_checkpoint) -> None:
    spec, engine = setting
    start = engine.cached_prompt_tokens
    first = engine.generate(LONG, GREEDY)
    again = engine.generate(LONG, GREEDY)
    cached = engine.cached_prompt_tokens - start
    if spec["enable_prefix_caching"]:
        assert cached >= 2 * 128  # each prompt's first full 128-token block, on the second call
    else:
        assert cached == 0
    expected = HFEngine(make_vllm_checkpoint(seed=0, tie=spec["tie"])).generate(LONG, GREEDY)
    assert [c.token_ids for c in first] == [c.token_ids for c in again] == [c.token_ids for c in expected]


@pytest.mark.timeout(120)
def test_publish_parity_tied_and_untied(setting: tuple[dict, VLLMEngine], make_vllm_checkpoint) -> None:
    spec, engine = setting
    target = make_vllm_checkpoint(seed=3, tie=spec["tie"])
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    if not spec["tie"]:
        assert "lm_head.weight" in dict(model.named_parameters())  # a head of its own travels too
    for bucket in weight_buckets(model, 30_000):
        engine.load_weights(bucket)
    engine.set_weight_version(1)
    prompts = [LONG[0], [30, 11, 8]]
    ours, theirs = engine.generate(prompts, GREEDY), HFEngine(target).generate(prompts, GREEDY)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.timeout(120)
def test_sleep_and_wake_are_skipped_on_cpu(setting: tuple[dict, VLLMEngine], make_vllm_checkpoint) -> None:
    spec, engine = setting
    assert engine.colocate is spec["colocate"]
    engine.sleep()
    assert not engine.sleeping  # vLLM has no sleep mode on CPU: nothing was released
    engine.wake_up()
    first = engine.generate([[30, 11, 8]], GREEDY)  # a colocated engine sleeps after generate (skipped here)
    assert not engine.sleeping
    path = make_vllm_checkpoint(seed=0, tie=spec["tie"])
    engine.load_weights(AutoModelForCausalLM.from_pretrained(path).state_dict(), version=2)
    assert engine.weight_version == 2
    assert (
        engine.generate([[30, 11, 8]], GREEDY)[0].token_ids
        == HFEngine(path).generate([[30, 11, 8]], GREEDY)[0].token_ids
    )
    assert len(first[0].token_ids) == GREEDY.max_tokens
