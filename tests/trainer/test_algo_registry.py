"""The algorithm tables: the trainer's (each algorithm's code) and the schema's (what each needs)
name the same algorithms, and each algorithm's code does what its row says."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rlfleet.common.schema.algorithms import ALGORITHM_NAMES, ALGORITHMS
from rlfleet.common.schema.batch import collate_pairs
from rlfleet.common.schema.trainer import StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms import TRAINER_ALGORITHMS
from rlfleet.trainer.algorithms.dpo import DPOObjective, dpo_loss
from rlfleet.trainer.algorithms.grpo import PolicyObjective
from rlfleet.trainer.critic import Critic

pytestmark = pytest.mark.timeout(120)

MakeBatch = Callable[..., dict[str, torch.Tensor]]
PROMPTS, RESPONSES = [3, 5, 2, 4], [4, 2, 6, 3]
SCORES = torch.tensor([1.0, 0.0, 0.2, 0.6])


def test_every_algorithm_name_has_a_spec_and_a_step() -> None:
    names = {"ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "dpo"}
    assert set(ALGORITHMS) == set(ALGORITHM_NAMES) == set(TRAINER_ALGORITHMS) == names
    for name, spec in ALGORITHMS.items():
        assert spec.name == name


def test_specs_say_what_each_algorithm_needs() -> None:
    ppo, grpo, dr, rloo, rpp, dpo = (
        ALGORITHMS[n] for n in ("ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "dpo")
    )
    assert [s.name for s in ALGORITHMS.values() if s.needs_critic] == ["ppo"]
    assert ppo.needs_reference and ppo.default_kl_mode == "reward"
    assert (
        grpo.uses_groups
        and dr.uses_groups
        and rloo.uses_groups
        and not rpp.uses_groups
        and not ppo.uses_groups
    )
    assert grpo.default_kl_mode == "loss" and dr.default_kl_mode == "loss"
    assert not dpo.online and dpo.default_kl_mode is None
    # critic-free algorithms load a reference only when a KL coefficient is set
    assert not grpo.uses_reference(0.0) and grpo.uses_reference(0.1)
    assert dpo.uses_reference(0.0)


def test_specs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ALGORITHMS["ppo"].needs_critic = False  # type: ignore[misc]


def _pairs() -> dict[str, torch.Tensor]:
    prompts, chosen, rejected = [[5, 6, 7], [8, 9]], [[10, 11], [12]], [[40, 41, 42], [43, 44]]
    return collate_pairs(prompts, chosen, rejected, pad_id=0)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_each_algorithms_code_does_what_its_row_says(
    tiny_model_dir: Path, make_batch: MakeBatch, name: str
) -> None:
    spec, algorithm = ALGORITHMS[name], TRAINER_ALGORITHMS[name]
    actor, critic = Actor(tiny_model_dir, seed=0), Critic(tiny_model_dir, seed=0)
    settings = StepSettings(algorithm=name, update=UpdateSettings(kl_coef=0.0, micro_batch_size=2))
    batch = make_batch(PROMPTS, RESPONSES) if spec.online else _pairs()
    plan = algorithm.plan(actor, critic, batch, SCORES, settings)
    trained = [objective.trainable for objective in plan.objectives]
    assert trained[-1] is actor
    assert (critic in trained) == spec.needs_critic  # a critic trained beside the policy
    assert (actor.ref_model is not None) == spec.needs_reference  # a reference without a KL coefficient
    # the loss: GRPO's clipped policy loss for the online algorithms, the DPO loss (dpo_loss) for dpo
    assert isinstance(plan.objectives[-1], PolicyObjective if spec.online else DPOObjective)
    # online: advantages from the scores; groups: they compare the samples of one prompt
    assert hasattr(algorithm, "token_advantages") == spec.online
    if not spec.online:
        assert not spec.uses_groups and dpo_loss.__module__ == type(algorithm).__module__
        return
    mask, values = batch["response_mask"], {"values": torch.zeros(batch["response_mask"].shape)}
    extra = values if spec.needs_critic else {}
    paired = algorithm.token_advantages(SCORES, torch.tensor([0, 0, 1, 1]), mask, settings, **extra)
    alone = algorithm.token_advantages(SCORES, torch.tensor([0, 1, 2, 3]), mask, settings, **extra)
    assert (not torch.equal(paired.advantages, alone.advantages)) == spec.uses_groups
    # ppo's advantages are GAE's over the critic: they come with the critic's returns
    assert (paired.returns is not None) == spec.needs_critic
