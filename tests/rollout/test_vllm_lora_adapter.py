"""A published LoRA adapter on the vLLM CPU build (issue 32, point 2): the engine, started with
``max_lora_rank``, serves the base plus the adapter without a restart (its logprobs become those of
the base with ``W + (alpha / rank) B A`` in each adapted layer, as the HF engine's); a second adapter
replaces the first; an adapter of a higher rank than the engine was started for, or one that does
not fit the model, is refused before anything changes.

Runs where vLLM is installed (``uv run --extra cpu pytest``); skipped otherwise. The adapters are
made by lora_adapters.py (this folder).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from lora_adapters import SETTINGS, adapted_model, make_adapter, teacher_forced  # (this folder's helper)

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.errors import BadAdapter

pytest.importorskip("vllm", reason="vLLM is not installed (uv sync --extra cpu)")

from rlfleet.rollout.engines.vllm import VLLMEngine  # noqa: E402

PROMPTS = [[2, 30, 11, 8, 15], [2, 5, 40, 6]]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=8, seed=7)


@pytest.fixture(scope="module")
def engine(make_vllm_checkpoint) -> Iterator[VLLMEngine]:  # noqa: ANN001
    vllm_engine = VLLMEngine(make_vllm_checkpoint(seed=0, tie=True), enforce_eager=True, max_model_len=64,
                             max_lora_rank=SETTINGS.rank)  # fmt: skip
    yield vllm_engine
    vllm_engine.close()


def _check_serves(engine: VLLMEngine, expected: torch.nn.Module) -> None:
    """Every sampled token's logprob is the one ``expected`` gives it."""
    for prompt, done in zip(PROMPTS, engine.generate(PROMPTS, SAMPLED), strict=True):
        want = teacher_forced(expected, prompt, done.token_ids)
        torch.testing.assert_close(torch.tensor(done.logprobs), want, atol=2e-4, rtol=0)


@pytest.mark.timeout(240)
def test_vllm_serves_the_adapter_without_a_restart_and_a_new_one_replaces_it(
    engine: VLLMEngine,
    make_vllm_checkpoint,  # noqa: ANN001
) -> None:
    path = make_vllm_checkpoint(seed=0, tie=True)
    base = adapted_model(path, {})
    _check_serves(engine, base)
    first = make_adapter(path, SETTINGS.target_modules, seed=1)
    engine.load_adapter(first, SETTINGS, version=1)
    assert engine.weight_version == 1
    _check_serves(engine, adapted_model(path, first))
    (done,) = engine.generate(PROMPTS[:1], SAMPLED)
    assert (torch.tensor(done.logprobs) - teacher_forced(base, PROMPTS[0], done.token_ids)).abs().max() > 1e-2

    second_settings = SETTINGS.model_copy(update={"target_modules": ["q_proj"]})
    second = make_adapter(path, ["q_proj"], seed=2)
    engine.load_adapter(second, second_settings, version=2)
    _check_serves(engine, adapted_model(path, second))

    higher = SETTINGS.model_copy(update={"rank": SETTINGS.rank + 2})
    with pytest.raises(BadAdapter, match="takes adapters up to rank"):
        engine.load_adapter(make_adapter(path, ["q_proj"], seed=3, rank=higher.rank), higher, version=3)
    misfit = make_adapter(path, ["q_proj"], seed=3)
    misfit = {n.replace("layers.0", "layers.7"): t for n, t in misfit.items()}
    with pytest.raises(BadAdapter, match="does not have"):
        engine.load_adapter(misfit, second_settings, version=3)
    assert engine.weight_version == 2
    _check_serves(engine, adapted_model(path, second))
