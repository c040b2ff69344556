"""Per-token estimators of KL(pi || ref) from the log-probabilities of the sampled tokens.

With samples drawn from pi and ``log_ratio = logp - ref_logp`` (Schulman, "Approximating KL
divergence", 2020):

- ``k1 = log_ratio``: unbiased, high variance, can be negative per token;
- ``k2 = 0.5 * log_ratio**2``: biased, low variance, always >= 0; its gradient is that of the true KL
  at first order;
- ``k3 = exp(-log_ratio) + log_ratio - 1 = exp(ref - logp) - (ref - logp) - 1``: unbiased, >= 0,
  low variance (GRPO's "low_var_kl").

k3 exponentiates, so one token whose log-ratio is large (a token the reference finds very
unlikely) would overflow or dominate the loss. ``clamp`` bounds the log-ratio to [-clamp, clamp]
before the exponential (default 20, as verl does): the value stays finite in float32 and the
gradient is zero beyond the bound. k1 and k2 do not need it; ``clamp=None`` disables it for k3.
All functions are elementwise: any shape in, the same shape out; mask and aggregate afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import Tensor

logger = logging.getLogger(__name__)

DEFAULT_LOG_RATIO_CLAMP = 20.0
"""Bound on |logp - ref_logp| inside k3 (see the module docstring)."""


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = logp - ref_logp, elementwise: (...) x (...) -> (...)."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 * (logp - ref_logp)^2, elementwise: (...) x (...) -> (...)."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, *, clamp: float | None = DEFAULT_LOG_RATIO_CLAMP) -> Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1, elementwise: (...) x (...) -> (...).

    Args:
        logprobs: (...) log-probabilities of the sampled tokens under the policy.
        ref_logprobs: (...) the same tokens under the reference model.
        clamp: bound on |ref - logp| before the exponential; None for none.

    Returns:
        (...) non-negative per-token estimates.
    """
    log_ratio = ref_logprobs - logprobs
    if clamp is not None:
        log_ratio = log_ratio.clamp(min=-clamp, max=clamp)
    return log_ratio.exp() - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}
"""Estimator name -> function(logprobs, ref_logprobs) -> per-token KL."""
