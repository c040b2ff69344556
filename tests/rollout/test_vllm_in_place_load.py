"""Which reload a vLLM worker uses (engines/vllm/worker.py): straight into the parameters on a CUDA
device for an unquantized model without LoRA, vLLM's layerwise reload everywhere else.

The in-place path itself runs only on a GPU (``benchmarks/vs_trl.py --device cuda`` exercises it and
records the trainer-engine logprob gap); here the choice is checked on the runner's own fields.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from rlfleet.rollout.engines.vllm.worker import loads_in_place  # noqa: E402


def runner(device: str = "cuda:0", quant: object = None, lora: object = None, method: str | None = None):
    model_config = SimpleNamespace(quantization=method)
    config = SimpleNamespace(quant_config=quant, lora_config=lora, model_config=model_config)
    return SimpleNamespace(device=device, vllm_config=config)


def test_an_unquantized_cuda_engine_without_lora_loads_in_place(monkeypatch):
    monkeypatch.delenv("RLFLEET_VLLM_LAYERWISE_RELOAD", raising=False)
    assert loads_in_place(runner())


@pytest.mark.parametrize(
    "made",
    [
        runner(device="cpu"),
        runner(quant=object()),
        runner(method="fp8"),
        runner(lora=object()),
        SimpleNamespace(device="cuda:0"),
    ],  # fmt: skip
    ids=["cpu", "quant-config", "quantization", "lora", "no-config"],
)
def test_every_other_engine_takes_the_layerwise_reload(monkeypatch, made):
    monkeypatch.delenv("RLFLEET_VLLM_LAYERWISE_RELOAD", raising=False)
    assert not loads_in_place(made)


def test_the_setting_keeps_the_layerwise_reload_on_a_gpu(monkeypatch):
    monkeypatch.setenv("RLFLEET_VLLM_LAYERWISE_RELOAD", "1")
    assert not loads_in_place(runner())
