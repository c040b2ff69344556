"""LoRA on the actor under FSDP2 ranks (issue 32, point 1): two gloo ranks on the CPU against one process.

The ranks run ``lora_ranks.py`` once for the module (its docstring says what they do and write): only
the adapters train and get gradients, the base weights stay as loaded, the reference (adapters off)
is the base, a publish gathers the merged weights and the adapter of one process, an export holds
both, a full checkpoint resumes exactly, and DPO starts at log 2.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_ranks import ADVANTAGES, LORA, STEPS, batch, lora_actor, train  # this folder's rank script
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlfleet.common.control.embedded_nats import free_port
from rlfleet.trainer.model_io import load_causal_lm
from rlfleet.trainer.policy import PolicyInputs, build_policy_inputs, token_logprobs

RANKS_SCRIPT = Path(__file__).with_name("lora_ranks.py")
SCALE = LORA["alpha"] / LORA["rank"]

pytestmark = pytest.mark.timeout(150)  # the two ranks start once for the module (about 8 s on 2 cores)

Run = tuple[Path, dict[str, Any], dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def ranks_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Run the two ranks once; their output directory, ``seen.json`` and ``tensors.safetensors``."""
    out = tmp_path_factory.mktemp("lora-fsdp")
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    logs = [open(out / f"rank{rank}.log", "wb") for rank in range(2)]  # noqa: SIM115  (closed below)
    command = [sys.executable, str(RANKS_SCRIPT), str(tiny_model_dir), str(out)]
    procs = [
        subprocess.Popen(
            command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT
        )  # fmt: skip
        for r, log in enumerate(logs)
    ]
    try:
        for proc in procs:
            proc.wait(timeout=120)
    finally:
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, (out / f"rank{rank}.log").read_text()[-3000:]
    return out, json.loads((out / "seen.json").read_text()), load_file(str(out / "tensors.safetensors"))


def _part(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}


@torch.no_grad()
def _logprobs_of(model: torch.nn.Module, inputs: PolicyInputs) -> torch.Tensor:
    """The response logprobs of a plain HF model (the actor's forward code, no actor)."""
    model.eval()
    return token_logprobs(model, inputs.input_ids, inputs.attention_mask, inputs.response_mask.shape[1],
                          position_ids=inputs.position_ids, compute_entropy=False)[0]  # fmt: skip


def test_two_ranks_train_only_the_adapters(ranks_run: Run, tiny_model_dir: Path) -> None:
    _, seen, tensors = ranks_run
    assert seen["dtensor_params"]  # sharded, adapters and base alike
    trainable = seen["trainable"]
    assert len(trainable) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert seen["optimized"] == len(trainable)
    assert seen["with_grad"] == trainable and seen["lora_B_grad_norm"] > 0  # the frozen base got none
    # the reference ran first; FSDP2 took its gradient dtypes from the adapters, still trainable there
    assert seen["adapters_require_grad_in_forwards"] and all(seen["adapters_require_grad_in_forwards"])
    assert seen["base_unchanged"]
    base = {
        n.replace(".base_layer.", "."): t for n, t in _part(tensors, "trained/").items() if ".lora_" not in n
    }
    loaded = load_causal_lm(tiny_model_dir).state_dict()
    assert base.keys() == loaded.keys() - {"lm_head.weight"}  # tied: the embedding
    for name, value in base.items():
        assert torch.equal(value, loaded[name]), name
    mask = batch()["response_mask"].bool()
    positive = torch.tensor(ADVANTAGES) > 0
    mean = {k: tensors[k][positive][mask[positive]].mean().item() for k in ("start", "after")}
    assert mean["after"] > mean["start"] + 0.05, mean  # the rewarded answers became likelier
    assert all(u["update_skipped"] == 0.0 for u in seen["updates"])


def test_the_reference_is_the_base_under_ranks(ranks_run: Run, tiny_model_dir: Path) -> None:
    _, _, tensors = ranks_run
    mask = batch()["response_mask"].bool()
    base = _logprobs_of(load_causal_lm(tiny_model_dir), build_policy_inputs(batch()))
    torch.testing.assert_close(tensors["ref_start"][mask], base[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tensors["start"][mask], base[mask], atol=1e-5, rtol=1e-5)  # B starts at 0
    assert torch.equal(tensors["ref_after"], tensors["ref_start"])  # training moved the adapters only


def test_two_ranks_publish_what_one_process_publishes(ranks_run: Run, tiny_model_dir: Path) -> None:
    out, seen, tensors = ranks_run
    single = lora_actor(str(tiny_model_dir))
    for ranked in seen["updates"]:
        metrics = train(single, batch())
        for key in ("loss", "pg_loss", "kl_loss", "grad_norm"):
            assert ranked[key] == pytest.approx(metrics[key], rel=1e-4), key
    merged = {n: t for b in single.iter_weight_buckets(1 << 20) for n, t in b.items()}
    adapter = {n: t for b in single.iter_weight_buckets(1 << 20, adapter=True) for n, t in b.items()}
    got_merged, got_adapter = _part(tensors, "merged/"), _part(tensors, "adapter/")
    assert got_merged.keys() == merged.keys() and got_adapter.keys() == adapter.keys()
    for name, value in [*merged.items(), *adapter.items()]:
        got = got_merged.get(name, got_adapter.get(name))
        # the gradients agree to 1e-8 (fp32 sums in another order); 6 AdamW steps at 5e-2 make it 1e-4
        torch.testing.assert_close(got, value, atol=5e-4, rtol=1e-3, msg=name)
    trained = _part(tensors, "trained/")  # the ranks' merged weights are theirs: W + scale * B A
    for name, lora_a in trained.items():
        if ".lora_A." in name:
            layer = name.removesuffix(".lora_A.default.weight")
            expected = (
                trained[f"{layer}.base_layer.weight"]
                + SCALE * trained[f"{layer}.lora_B.default.weight"] @ lora_a
            )
            torch.testing.assert_close(got_merged[f"{layer}.weight"], expected, atol=1e-6, rtol=1e-6)
    main, other = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    for kind in ("merged", "adapter"):  # rank 1 gathers bucket for bucket with rank 0, keeps nothing
        assert len(main[kind]) == len(other[kind]) > 1 and all(main[kind]) and not any(other[kind])


def test_the_export_under_ranks_holds_the_merged_model_and_the_adapter(
    ranks_run: Run, tiny_model_dir: Path
) -> None:
    out, _, tensors = ranks_run
    inputs = build_policy_inputs(batch())
    mask = batch()["response_mask"].bool()
    merged = AutoModelForCausalLM.from_pretrained(out / "hf")
    torch.testing.assert_close(
        _logprobs_of(merged, inputs)[mask], tensors["after"][mask], atol=1e-5, rtol=1e-5
    )
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), out / "hf" / "adapter"
    )
    torch.testing.assert_close(
        _logprobs_of(adapted, inputs)[mask], tensors["after"][mask], atol=1e-5, rtol=1e-5
    )


def test_a_lora_checkpoint_under_ranks_resumes_exactly(ranks_run: Run) -> None:
    out, seen, tensors = ranks_run
    assert (out / "ckpt" / "hf" / "adapter" / "adapter_config.json").is_file()
    assert seen["loaded_step"] == 2 * STEPS  # two optimizer steps an update
    assert seen["resumed_update"] == seen["expected_update"]
    expected, resumed = _part(tensors, "expected/"), _part(tensors, "resumed/")
    assert expected.keys() == resumed.keys() and len(expected) == len(seen["trainable"])
    for name, value in expected.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)


def test_dpo_with_lora_under_ranks_starts_at_log_2(ranks_run: Run) -> None:
    _, seen, _ = ranks_run
    first, second = seen["dpo"]
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-5)  # the policy starts as its reference
    assert second["loss"] < first["loss"] and second["dpo/margin"] > 0
