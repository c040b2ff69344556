"""The Actor on a tiny Llama under the update loop: gradient accumulation, update direction,
reference/KL, metrics, seeding."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from batches import update  # this folder's helper module (conftest puts it on sys.path)
from pydantic import ValidationError

from rlfleet.common.schema.trainer import BatchSettings, ModelSettings, StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.grpo import LOSS_AGG_MODES, PolicyObjective, prepare
from rlfleet.trainer.loop import accumulate, batch_sizes
from rlfleet.trainer.model_io import BLOCK_VARIANTS, disable_dropout, load_causal_lm
from rlfleet.trainer.policy import build_policy_inputs, compute_logprobs

pytestmark = pytest.mark.timeout(120)

PROMPTS, RESPONSES = [3, 5, 2, 4, 5], [4, 2, 6, 1, 3]


def _actor(path: Path, lr: float = 1e-3, *, seed: int = 0, **model: object) -> Actor:
    return Actor(path, ModelSettings(**model), seed=seed, learning_rate=lr, weight_decay=0.0)


def _grads(actor: Actor) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    actor.optimizer.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_micro_batching_gives_the_full_batch_gradient(
    tiny_model_dir: Path, make_batch: Callable, loss_agg: str
) -> None:
    actor = _actor(tiny_model_dir)
    batch = make_batch(PROMPTS, RESPONSES)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3])
    prepared = prepare(actor, batch, adv, micro_batch_size=5, with_reference=True)
    # move old and ref logprobs away from the policy so that clipping and KL both act
    noise = torch.randn(prepared.old_logprobs.shape, generator=torch.Generator().manual_seed(0))
    prepared = dataclasses.replace(
        prepared, old_logprobs=prepared.old_logprobs + 0.3 * noise, ref_logprobs=prepared.ref_logprobs - 0.2
    )
    settings = StepSettings(update=UpdateSettings(kl_coef=0.1, entropy_coef=0.01, loss_agg=loss_agg))
    loss = PolicyObjective(actor, prepared, settings)
    rows = torch.arange(5)
    full_metrics = accumulate(loss, rows, 5)
    full = _grads(actor)
    assert full_metrics["clip_frac"] > 0
    assert sum(g.abs().sum().item() for g in full.values()) > 0
    for micro in (1, 2, 3):
        metrics = accumulate(loss, rows, micro)
        grads = _grads(actor)
        assert grads.keys() == full.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, full[name], atol=1e-6, rtol=1e-4, msg=name)
        for key, value in full_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_update_moves_the_logprob_of_the_advantaged_sample(
    tiny_model_dir: Path, make_batch: Callable, sign: float
) -> None:
    actor = _actor(tiny_model_dir, lr=1e-2)
    batch = make_batch(PROMPTS, RESPONSES)
    inputs = build_policy_inputs(batch)
    before = compute_logprobs(actor, inputs, micro_batch_size=5)[0].sum().item()
    adv = torch.tensor([sign, 0.0, 0.0, 0.0, 0.0])
    metrics = update(actor, batch, adv, micro_batch_size=2)
    after = compute_logprobs(actor, inputs, micro_batch_size=5)[0].sum().item()
    assert sign * (after - before) > 0.05
    # first step of an update: the policy is the sampling policy, so nothing is clipped
    assert metrics["clip_frac"] == 0.0
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["num_optimizer_steps"] == 1.0
    assert metrics["response_length"] == pytest.approx(sum(RESPONSES) / 5)
    assert metrics["lr"] == pytest.approx(1e-2)
    assert metrics["grad_norm"] > 0
    assert "kl" not in metrics and actor.ref_model is None


def test_bf16_autocast_on_cpu_keeps_fp32_weights_and_updates_in_the_advantaged_direction(
    tiny_model_dir: Path, make_batch: Callable
) -> None:
    # the suite pins fp32 for auto (tests/conftest.py); a CPU with AVX512-BF16 or AMX runs this path
    # by default, so it is tested explicitly here
    fp32, bf16 = _actor(tiny_model_dir, lr=1e-2), _actor(tiny_model_dir, lr=1e-2, mixed_precision="bf16")
    batch = make_batch(PROMPTS, RESPONSES)
    inputs = build_policy_inputs(batch)
    exact = compute_logprobs(fp32, inputs, micro_batch_size=5)
    before = compute_logprobs(bf16, inputs, micro_batch_size=5)
    assert before.dtype == torch.float32
    mask = batch["response_mask"].bool()
    assert 0 < (before - exact)[mask].abs().max().item() < 0.1  # computed in bf16, close to fp32
    metrics = update(bf16, batch, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]), micro_batch_size=2)
    after = compute_logprobs(bf16, inputs, micro_batch_size=5)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert after[0].sum().item() - before[0].sum().item() > 0.05
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())


def test_rollout_logprob_diff_reports_engine_drift(tiny_model_dir: Path, make_batch: Callable) -> None:
    actor = _actor(tiny_model_dir, lr=1e-9)
    batch = make_batch(PROMPTS, RESPONSES)
    exact = compute_logprobs(actor, build_policy_inputs(batch), micro_batch_size=5)
    metrics = update(actor, dict(batch, rollout_logprobs=exact), torch.zeros(5), micro_batch_size=5)
    assert metrics["rollout_logprob_diff"] == pytest.approx(0.0, abs=1e-6)
    metrics = update(
        actor, dict(batch, rollout_logprobs=torch.zeros_like(exact)), torch.zeros(5), micro_batch_size=5
    )
    mask = batch["response_mask"].bool()
    assert metrics["rollout_logprob_diff"] == pytest.approx(exact[mask].abs().mean().item(), rel=1e-4)

    # NaN: tokens no engine produced (responses a rollout fn wrote) stay out of the drift
    unknown = torch.zeros_like(exact)
    unknown[:2] = float("nan")
    metrics = update(actor, dict(batch, rollout_logprobs=unknown), torch.zeros(5), micro_batch_size=5)
    rest = mask.clone()
    rest[:2] = False
    assert metrics["rollout_logprob_diff"] == pytest.approx(exact[rest].abs().mean().item(), rel=1e-4)
    all_unknown = torch.full_like(exact, float("nan"))
    metrics = update(actor, dict(batch, rollout_logprobs=all_unknown), torch.zeros(5), micro_batch_size=5)
    assert "rollout_logprob_diff" not in metrics and math.isfinite(metrics["loss"])


def test_kl_to_a_frozen_reference(tiny_model_dir: Path, make_batch: Callable) -> None:
    actor = _actor(tiny_model_dir, lr=1e-2)
    batch = make_batch(PROMPTS, RESPONSES)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    first = update(actor, batch, adv, micro_batch_size=5, kl_coef=0.1)
    ref = actor.ref_model
    assert ref is not None and not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy still equals the reference
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-7)
    second = update(actor, batch, adv, micro_batch_size=5, kl_coef=0.1)
    assert second["kl"] > 1e-5
    ref_state = ref.state_dict()
    fresh = _actor(tiny_model_dir).model.state_dict()
    for name, value in fresh.items():
        torch.testing.assert_close(ref_state[name], value, msg=name)


def test_ppo_epochs_and_mini_batches(tiny_model_dir: Path, make_batch: Callable) -> None:
    actor = Actor(tiny_model_dir, learning_rate=1e-2, weight_decay=0.01, warmup_steps=4)
    batch = make_batch(PROMPTS, RESPONSES)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    metrics = update(actor, batch, adv, micro_batch_size=2, num_updates=3, ppo_epochs=2)  # mini-batches of 2
    assert metrics["num_optimizer_steps"] == 6.0  # ceil(5 / 2) mini-batches x 2 epochs
    assert actor.steps == 6
    # warmup: lr_k = lr * min(1, (k + 1) / 4) for steps k = 0..5
    expected_lr = 1e-2 * sum(min(1.0, (k + 1) / 4) for k in range(6)) / 6
    assert metrics["lr"] == pytest.approx(expected_lr)
    assert metrics["approx_kl"] > 0  # later mini-batches see a moved policy


def test_same_seed_same_training(tiny_model_dir: Path, make_batch: Callable) -> None:
    batch = make_batch(PROMPTS, RESPONSES)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0])
    states = []
    for _ in range(2):
        actor = _actor(tiny_model_dir, seed=7)
        update(actor, batch, adv, micro_batch_size=2, num_updates=2, ppo_epochs=2)  # mini-batches of 3
        states.append(actor.model.state_dict())
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=0, atol=0, msg=name)


def test_update_validates_its_settings(tiny_model_dir: Path, make_batch: Callable) -> None:
    actor = _actor(tiny_model_dir)
    batch = make_batch(PROMPTS, RESPONSES)
    with pytest.raises(ValidationError, match="loss_agg"):
        update(actor, batch, torch.zeros(5), micro_batch_size=2, loss_agg="mean-of-means")
    # a micro-batch never spans more than a mini-batch: 5 rows in 3 updates are mini-batches of 2
    three_updates = StepSettings(update=UpdateSettings(micro_batch_size=4),
                                 batch=BatchSettings(rollout_batch_size=3, train_batch_size=1))  # fmt: skip
    assert batch_sizes(three_updates, 5) == (2, 2)
    prepared = prepare(actor, batch, torch.zeros(5), micro_batch_size=5)
    with pytest.raises(ValueError, match="with_reference"):
        PolicyObjective(actor, prepared, StepSettings(update=UpdateSettings(kl_coef=0.1)))


def test_gradient_checkpointing_gives_the_same_gradient(tiny_model_dir: Path, make_batch: Callable) -> None:
    batch = make_batch(PROMPTS, RESPONSES)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0])
    grads = []
    for checkpointing in (False, True):
        actor = _actor(tiny_model_dir, gradient_checkpointing=checkpointing)
        prepared = prepare(actor, batch, adv, micro_batch_size=5)
        no_kl = StepSettings(update=UpdateSettings(kl_coef=0.0))
        accumulate(PolicyObjective(actor, prepared, no_kl), torch.arange(5), 2)
        grads.append(_grads(actor))
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_the_compile_setting_compiles_policy_and_reference_blocks(tiny_model_dir: Path) -> None:
    # construction only wraps each block's forward; nothing compiles until the first forward
    actor = _actor(tiny_model_dir, compile=True)
    assert actor.compiled
    for model in (actor.model, actor.reference()):
        assert all(hasattr(block.forward, "_torchdynamo_orig_callable") for block in model.model.layers)
    assert not _actor(tiny_model_dir).compiled
    assert not Actor(tiny_model_dir, ModelSettings(compile=True), compile=False).compiled  # the argument wins


def test_compiled_blocks_may_recompile_for_every_variant_of_a_step(tiny_model_dir: Path) -> None:
    # grad on and off, the first block's input without grad, LoRA's adapters off for the reference:
    # past torch's default of 8 recompiles the blocks ran eagerly (a LoRA 1.5B run at 0.71x); torch's
    # own patch puts the limit back as it was (pytest's monkeypatch deletes a torch config on undo)
    with torch._dynamo.config.patch(recompile_limit=8):
        _actor(tiny_model_dir, compile=True)
        assert torch._dynamo.config.recompile_limit >= BLOCK_VARIANTS >= 32


def test_dropout_is_disabled_so_the_first_ratio_is_one(
    tiny_model_dir: Path, make_batch: Callable, tmp_path: Path
) -> None:
    model = load_causal_lm(tiny_model_dir)
    model.config.attention_dropout = 0.5
    model.save_pretrained(tmp_path)
    actor = _actor(tmp_path)
    metrics = update(actor, make_batch(PROMPTS, RESPONSES), torch.ones(5), micro_batch_size=5)
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-9)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    disable_dropout(layer)
    x = torch.randn(8, 4)
    torch.testing.assert_close(layer.train()(x), layer.eval()(x))


def test_forwards_run_without_the_cudnn_attention_kernel(tiny_model_dir: Path) -> None:
    """cuDNN's SDPA plans each new shape (0.69 s of host time in a profiled GPU update): a trainer's
    forwards leave it out and keep the shape-free kernels; outside them the flags are as they were."""
    actor = Actor(tiny_model_dir, seed=0)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with actor.computing():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
