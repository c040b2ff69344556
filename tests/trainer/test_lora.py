"""LoRA on the actor (issue 32, point 1, one process): only the adapters train; the reference is the
base with them off (no second copy); what a publish sends and an export writes is the merged model,
which computes what the trained policy computes; the adapter is exported in PEFT's format."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from batches import update  # this folder's helper module (conftest puts it on sys.path)
from peft import PeftModel
from transformers import AutoModelForCausalLM

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.trainer import ModelSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.model_io import load_causal_lm
from rlfleet.trainer.policy import PolicyInputs, build_policy_inputs, compute_logprobs, token_logprobs

pytestmark = pytest.mark.timeout(120)

PROMPTS, RESPONSES = [3, 5, 2, 4, 5], [4, 2, 6, 1, 3]
LORA = {"rank": 4, "alpha": 8.0}


def _lora_actor(path: Path, lr: float = 5e-2, **lora: object) -> Actor:
    return Actor(path, ModelSettings(lora={**LORA, **lora}), seed=0, learning_rate=lr, weight_decay=0.0)


def _trained(tiny_model_dir: Path, make_batch: Callable) -> tuple[Actor, dict[str, torch.Tensor]]:
    actor = _lora_actor(tiny_model_dir)
    batch = make_batch(PROMPTS, RESPONSES)
    for _ in range(3):
        update(actor, batch, torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5]), micro_batch_size=2)
    return actor, batch


def test_only_the_adapters_train_and_the_reference_is_the_base(
    tiny_model_dir: Path, make_batch: Callable
) -> None:
    actor = _lora_actor(tiny_model_dir)
    trained = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(trained) == 2 * 7 * 2  # A and B on 7 linear layers of 2 blocks
    in_optimizer = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in actor.model.named_parameters() if n in trained}
    base = load_causal_lm(tiny_model_dir)
    base_weights = {n: t.clone() for n, t in base.state_dict().items()}
    batch = make_batch(PROMPTS, RESPONSES)
    inputs = build_policy_inputs(batch)
    start = compute_logprobs(actor, inputs, micro_batch_size=5)
    update(actor, batch, torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5]), micro_batch_size=2)
    after = compute_logprobs(actor, inputs, micro_batch_size=5)
    reference = compute_logprobs(actor, inputs, micro_batch_size=5, reference=True)
    mask = batch["response_mask"].bool()
    assert (after - start)[mask].abs().max() > 1e-3, "the adapters moved the policy"
    torch.testing.assert_close(reference[mask], start[mask])  # B starts at 0: the start is the base
    assert actor.ref_model is not None and list(actor.ref_model.children()) == [actor.model]  # no copy
    for name, tensor in load_causal_lm(tiny_model_dir).state_dict().items():  # the base weights untouched
        assert torch.equal(tensor, base_weights[name]), name


def test_the_published_and_exported_weights_compute_the_trained_policy(
    tiny_model_dir: Path, make_batch: Callable, tmp_path: Path
) -> None:
    actor, batch = _trained(tiny_model_dir, make_batch)
    inputs = build_policy_inputs(batch)
    mask = batch["response_mask"].bool()
    policy = compute_logprobs(actor, inputs, micro_batch_size=5)
    published = {n: t for bucket in actor.iter_weight_buckets(1 << 12) for n, t in bucket.items()}
    engine = load_causal_lm(tiny_model_dir)  # what a rollout engine holds, then loads the publish into
    assert set(published) <= set(engine.state_dict()), "HF names only"
    engine.load_state_dict(published, strict=False)
    as_engine = _logprobs_of(engine, inputs)
    torch.testing.assert_close(as_engine[mask], policy[mask], atol=1e-5, rtol=1e-5)
    out = actor.save_hf(tmp_path / "export")
    merged = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logprobs_of(merged, inputs)[mask], policy[mask], atol=1e-5, rtol=1e-5)
    assert (out / "adapter" / "adapter_config.json").is_file()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out / "adapter")
    torch.testing.assert_close(_logprobs_of(adapted, inputs)[mask], policy[mask], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def _logprobs_of(model: torch.nn.Module, inputs: PolicyInputs) -> torch.Tensor:
    """The response logprobs of a plain HF model (the actor's forward code, no actor)."""
    model.eval()
    return token_logprobs(model, inputs.input_ids, inputs.attention_mask, inputs.response_mask.shape[1],
                          position_ids=inputs.position_ids, compute_entropy=False)[0]  # fmt: skip


def test_lora_settings_that_cannot_apply_are_refused_by_name(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.lora.target_modules.*\['qkv'\] name no linear layer"):
        _lora_actor(tiny_model_dir, target_modules=["q_proj", "qkv"])
    with pytest.raises(ConfigError, match="unset model.trainable_layers"):
        Actor(tiny_model_dir, ModelSettings(lora=LORA, trainable_layers=1), seed=0)


def test_a_lora_checkpoint_resumes_exactly(
    tiny_model_dir: Path, make_batch: Callable, tmp_path: Path
) -> None:
    """The adapters and their optimizer state come back; the run goes on as if never stopped."""
    from rlfleet.trainer.checkpoint import load_checkpoint, save_checkpoint

    batch = make_batch(PROMPTS, RESPONSES)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5])
    actor = _lora_actor(tiny_model_dir)
    update(actor, batch, adv, micro_batch_size=2)
    save_checkpoint(tmp_path / "ckpt", actor, None, mode="full")
    assert (tmp_path / "ckpt" / "hf" / "adapter" / "adapter_config.json").is_file()
    expected = update(actor, batch, adv, micro_batch_size=2)
    torch.manual_seed(999)
    other = _lora_actor(tiny_model_dir)
    assert load_checkpoint(tmp_path / "ckpt", other, None) == actor.steps - 1
    got = update(other, batch, adv, micro_batch_size=2)
    assert got == expected
    for (name, x), (_, y) in zip(
        actor.model.state_dict().items(), other.model.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)


def test_dpo_trains_the_adapters_against_the_base(tiny_model_dir: Path) -> None:
    """DPO with LoRA: the first step's loss is log 2 (the adapted policy starts as its reference, the
    base with adapters off), and its steps raise the chosen answers over the rejected."""
    import math

    from rlfleet.common.schema.trainer import AlgorithmSettings, StepSettings, UpdateSettings
    from rlfleet.trainer.algorithms.dpo import DPO
    from rlfleet.trainer.loop import train_loop

    gen = torch.Generator().manual_seed(0)
    n = 6
    batch = {
        key: torch.ones((n, 4), dtype=torch.int64) for key in ("prompt_mask", "chosen_mask", "rejected_mask")
    }
    batch["prompt_ids"] = torch.randint(3, 64, (n, 4), generator=gen)
    batch["chosen_ids"] = torch.randint(3, 33, (n, 4), generator=gen)
    batch["rejected_ids"] = torch.randint(33, 64, (n, 4), generator=gen)
    actor = _lora_actor(tiny_model_dir, lr=5e-2)
    step = StepSettings(
        algorithm=AlgorithmSettings(name="dpo", beta=0.5), update=UpdateSettings(micro_batch_size=6)
    )
    first = train_loop(DPO().plan(actor, None, batch, torch.zeros(0), step))
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-5)
    for _ in range(5):
        last = train_loop(DPO().plan(actor, None, batch, torch.zeros(0), step))
    assert last["loss"] < first["loss"] - 0.05 and last["dpo/margin"] > 0
