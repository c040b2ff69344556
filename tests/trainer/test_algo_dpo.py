"""DPO, conservative DPO and IPO losses and metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.trainer.algorithms.dpo import DPO_LOSS_TYPES, DPO_LOSSES, dpo_loss, sequence_logprobs

# two pairs, beta = 0.5
PI_C = torch.tensor([-1.0, -4.0])
PI_R = torch.tensor([-3.0, -2.0])
REF_C = torch.tensor([-2.0, -3.0])
REF_R = torch.tensor([-2.0, -2.0])
# chosen log-ratios pi_c - ref_c = [1, -1]; rejected pi_r - ref_r = [-1, 0]; h = [2, -1]; beta*h = [1, -0.5]
L1 = math.log1p(math.exp(-1.0))  # -logsigmoid(1)
L2 = math.log1p(math.exp(0.5))  # -logsigmoid(-0.5)


def test_sequence_logprobs_sum_and_mean() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0], [-9.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(sequence_logprobs(logp, mask), torch.tensor([-6.0, -0.5, 0.0]))
    torch.testing.assert_close(sequence_logprobs(logp, mask, average=True), torch.tensor([-2.0, -0.5, 0.0]))
    with pytest.raises(ValueError, match=r"\(N, R\)"):
        sequence_logprobs(logp, mask[:, :2])


def test_sigmoid_loss_and_metrics_by_hand() -> None:
    loss, m = dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.5)
    torch.testing.assert_close(loss, torch.tensor((L1 + L2) / 2))
    torch.testing.assert_close(m["chosen_reward"], torch.tensor(0.0))  # 0.5 * [1, -1]
    torch.testing.assert_close(m["rejected_reward"], torch.tensor(-0.25))  # 0.5 * [-1, 0]
    torch.testing.assert_close(m["accuracy"], torch.tensor(0.5))  # 0.5 > -0.5 yes, -0.5 > 0 no
    torch.testing.assert_close(m["margin"], torch.tensor(0.25))  # [1.0, -0.5]


def test_gradient_flows_to_the_policy_only() -> None:
    pi_c = PI_C.clone().requires_grad_(True)
    pi_r = PI_R.clone().requires_grad_(True)
    loss, metrics = dpo_loss(pi_c, pi_r, REF_C, REF_R, beta=0.5)
    loss.backward()
    # d/dpi_c of -logsigmoid(beta*h) / 2 = -beta * sigmoid(-beta*h) / 2; d/dpi_r is the opposite
    sig = torch.sigmoid(-torch.tensor([1.0, -0.5]))
    torch.testing.assert_close(pi_c.grad, -0.25 * sig)
    torch.testing.assert_close(pi_r.grad, 0.25 * sig)
    assert all(not v.requires_grad for v in metrics.values())


def test_label_smoothing_by_hand() -> None:
    loss, _ = dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.5, label_smoothing=0.1)
    # 0.9*log(1+e^-x) + 0.1*log(1+e^x) = log(1+e^-x) + 0.1*x, x = beta*h = [1, -0.5]
    torch.testing.assert_close(loss, torch.tensor((L1 + 0.1 + L2 - 0.05) / 2))


def test_ipo_by_hand() -> None:
    loss, m = dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.5, loss_type="ipo")
    # (h - 1/(2*0.5))^2 = (2 - 1)^2, (-1 - 1)^2 = 1, 4
    torch.testing.assert_close(loss, torch.tensor(2.5))
    torch.testing.assert_close(m["accuracy"], torch.tensor(0.5))


def test_policy_equal_to_reference_gives_log_two() -> None:
    logp = torch.tensor([-3.0, -1.0, -2.0])
    loss, m = dpo_loss(logp, logp - 1, logp, logp - 1, beta=0.1)
    torch.testing.assert_close(loss, torch.tensor(math.log(2.0)))
    assert m["accuracy"].item() == 0.0  # ties do not count as correct
    assert m["margin"].item() == 0.0


def test_micro_batches_sum_to_the_batch_loss() -> None:
    full, _ = dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.5)
    total = torch.zeros(())
    for i in range(2):
        one = slice(i, i + 1)
        part, _ = dpo_loss(PI_C[one], PI_R[one], REF_C[one], REF_R[one], beta=0.5, num_pairs=2)
        total = total + part
    torch.testing.assert_close(total, full)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(PI_C, PI_R, REF_C, REF_R, label_smoothing=0.5)
    with pytest.raises(ValueError, match="sigmoid loss only"):
        dpo_loss(PI_C, PI_R, REF_C, REF_R, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(PI_C, PI_R, REF_C, REF_R, loss_type="hinge")
    with pytest.raises(ValueError, match="ref_rejected"):
        dpo_loss(PI_C, PI_R, REF_C, REF_R[:1])


def test_registry_names_every_loss_type() -> None:
    assert set(DPO_LOSSES) == set(DPO_LOSS_TYPES) == {"sigmoid", "ipo"}
    h = torch.tensor([0.3, -0.2])
    for name, fn in DPO_LOSSES.items():
        out = fn(h, beta=0.1, label_smoothing=0.0)
        assert out.shape == (2,) and torch.isfinite(out).all(), name


def test_zero_weights_leave_pairs_out_of_loss_and_metrics() -> None:
    """A rank's padding copies weigh 0: loss and metrics are those of the real pairs alone."""
    doubled = [torch.cat([t, t[:1]]) for t in (PI_C, PI_R, REF_C, REF_R)]
    weights = torch.tensor([1.0, 1.0, 0.0])
    loss, metrics = dpo_loss(*doubled, beta=0.5, weights=weights)
    expected, expected_metrics = dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.5)
    torch.testing.assert_close(loss, expected)
    for name, value in expected_metrics.items():
        torch.testing.assert_close(metrics[name], value, msg=name)
    nothing, empty = dpo_loss(*doubled, beta=0.5, weights=torch.zeros(3), num_pairs=3.0)
    assert nothing.item() == 0.0 and all(v.item() == 0.0 for v in empty.values())
