"""The algorithm registry: every configurable name resolves, and each spec says what it needs."""

from __future__ import annotations

import dataclasses

import pytest

from rlfleet.trainer.algorithms import (
    ADVANTAGES,
    ALGORITHM_NAMES,
    ALGORITHMS,
    GAE,
    POLICY_LOSSES,
    dpo_loss,
    ppo_policy_loss,
)


def test_every_algorithm_name_has_a_spec() -> None:
    assert set(ALGORITHMS) == set(ALGORITHM_NAMES) == {"ppo", "grpo", "rloo", "reinforce_pp", "dpo"}
    for name, spec in ALGORITHMS.items():
        assert spec.name == name
        assert spec.policy_loss in POLICY_LOSSES, name
        assert spec.advantage is None or spec.advantage == GAE or spec.advantage in ADVANTAGES, name


def test_specs_say_what_each_algorithm_needs() -> None:
    ppo, grpo, rloo, rpp, dpo = (ALGORITHMS[n] for n in ("ppo", "grpo", "rloo", "reinforce_pp", "dpo"))
    assert [s.name for s in ALGORITHMS.values() if s.needs_critic] == ["ppo"]
    assert ppo.advantage == GAE and ppo.needs_reference and ppo.default_kl_mode == "reward"
    assert grpo.uses_groups and rloo.uses_groups and not rpp.uses_groups and not ppo.uses_groups
    assert grpo.default_kl_mode == "loss"
    assert not dpo.online and dpo.advantage is None and dpo.default_kl_mode is None
    assert POLICY_LOSSES[dpo.policy_loss] is dpo_loss
    assert POLICY_LOSSES[grpo.policy_loss] is ppo_policy_loss
    # critic-free algorithms load a reference only when a KL coefficient is set
    assert not grpo.uses_reference(0.0) and grpo.uses_reference(0.1)
    assert dpo.uses_reference(0.0)


def test_specs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ALGORITHMS["ppo"].needs_critic = False  # type: ignore[misc]
