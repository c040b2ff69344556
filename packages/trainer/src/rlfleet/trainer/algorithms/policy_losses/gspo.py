"""GSPO: Group Sequence Policy Optimization (Zheng et al., 2025, Qwen), a sequence-level ratio.

A sequence's importance ratio is the geometric mean of its tokens' ratios, so its size does not grow
with the length, and the clip acts on whole sequences (the paper's reason: token ratios are too
noisy to clip one by one, which destabilises mixture-of-experts models)::

    s_i = exp( 1/|y_i| * sum_t (logp_{i,t} - old_logp_{i,t}) )
    l_i = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)

Computed per token in the paper's GSPO-token form, ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]``:
every token of a sequence has the value ``s_i`` and the gradient ``s_i * grad logp_t``, so with a
sequence's token mean (``loss_agg: seq-mean-token-mean``, GSPO's) the loss and its gradient are the
paper's, and per-token advantages (PPO's GAE, REINFORCE++'s returns) work too. The paper's clip
ranges are far tighter than PPO's (``clip_eps: 3e-4``, ``clip_eps_high: 4e-4``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfleet.common.schema.trainer import UpdateSettings

LOG_RATIO_CLAMP = 20.0
"""Bound on a sequence's mean log-ratio before the exponential."""


def gspo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, update: UpdateSettings
) -> tuple[Tensor, Tensor]:
    """Per-token GSPO loss (N, R) and where the sequence clip acted (N, R); see the module docstring."""
    low, high = update.clip_range
    weights = mask.to(logprobs.dtype)
    tokens = weights.sum(dim=-1).clamp(min=1.0)
    seq_log_ratio = ((logprobs - old_logprobs) * weights).sum(dim=-1) / tokens  # (N,)
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()  # value s_i, grad per token
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).to(logprobs.dtype)
