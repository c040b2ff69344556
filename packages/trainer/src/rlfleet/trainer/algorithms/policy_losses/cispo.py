"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, 2025).

PPO's clip drops the gradient of every token whose ratio leaves the range, and those are often the
rare tokens a reasoning model most needs to learn from (a "however", a "wait"). CISPO keeps a
REINFORCE gradient on every token and clips only its importance weight, which carries no gradient::

    w_t = sg( clip(rho_t, 1 - eps_low, 1 + eps_high) ),   rho_t = exp(logp_t - old_logp_t)
    l_t = -w_t * A_t * logp_t

``eps_low`` is ``update.clip_eps`` (the paper leaves the lower side unbounded: a ``clip_eps`` of 1 or
more does that here, the weight then only kept at or above 0), ``eps_high`` is ``update.clip_eps_high``
(``clip_eps`` when unset). The loss's value is the weighted logprob, not a surrogate near 0; its
gradient is ``-w_t * A_t * grad logp_t`` on every token.
"""

from __future__ import annotations

from torch import Tensor

from rlfleet.common.schema.trainer import UpdateSettings


def cispo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, update: UpdateSettings
) -> tuple[Tensor, Tensor]:
    """Per-token CISPO loss (N, R) and where the weight was clipped (N, R); see the module docstring."""
    low, high = update.clip_range
    ratio = (logprobs - old_logprobs).detach().exp()
    weight = ratio.clamp(max(0.0, 1.0 - low), 1.0 + high)
    return -weight * advantages * logprobs, (weight != ratio).to(logprobs.dtype)
