"""KL estimators k1, k2, k3 against hand-computed values and the exact KL."""

from __future__ import annotations

import math

import torch

from rlfleet.trainer.algorithms.grpo import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3


def test_estimators_on_one_token() -> None:
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    ln2 = math.log(2.0)
    torch.testing.assert_close(kl_k1(logp, ref), torch.tensor([ln2]))
    torch.testing.assert_close(kl_k2(logp, ref), torch.tensor([0.5 * ln2**2]))
    torch.testing.assert_close(kl_k3(logp, ref), torch.tensor([0.5 + ln2 - 1.0]))  # r = 0.5


def test_equal_logprobs_give_zero() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.1]])
    for fn in KL_ESTIMATORS.values():
        torch.testing.assert_close(fn(logp, logp), torch.zeros_like(logp))


def test_k1_and_k3_are_unbiased_for_the_exact_kl() -> None:
    """Expectations under pi of k1 and k3 equal KL(pi || ref) exactly, k3 is >= 0 everywhere."""
    pi = torch.tensor([0.5, 0.3, 0.2])
    ref = torch.tensor([0.2, 0.2, 0.6])
    exact = (pi * (pi / ref).log()).sum()
    k1 = kl_k1(pi.log(), ref.log())
    k3 = kl_k3(pi.log(), ref.log())
    torch.testing.assert_close((pi * k1).sum(), exact)
    torch.testing.assert_close((pi * k3).sum(), exact)
    assert (k3 >= 0).all()
    assert (k1 < 0).any()  # k1 can be negative per token


def test_k3_clamps_the_log_ratio() -> None:
    logp, ref = torch.tensor([-100.0, 0.0]), torch.tensor([0.0, -100.0])
    clamped = kl_k3(logp, ref)
    torch.testing.assert_close(clamped, torch.tensor([math.exp(20.0) - 21.0, math.exp(-20.0) + 19.0]))
    assert torch.isinf(kl_k3(logp, ref, clamp=None)[0])
    torch.testing.assert_close(kl_k3(logp, ref, clamp=1.0)[1], torch.tensor(math.exp(-1.0)))


def test_k3_gradient_is_zero_beyond_the_clamp() -> None:
    logp = torch.tensor([-50.0, -0.5], requires_grad=True)
    ref = torch.tensor([0.0, -1.0])
    kl_k3(logp, ref).sum().backward()
    assert logp.grad is not None
    assert logp.grad[0].item() == 0.0
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad[1], torch.tensor(1.0 - math.exp(-0.5)))
