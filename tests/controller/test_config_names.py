"""The names users bring (issue 35, point 4): another framework's key gets rlfleet's in one line, a
did-you-mean is shown alone, and a setting the chosen algorithm does not read is refused with the
one that does its job."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.config import load_config, section_class, union_members
from rlfleet.controller.cli import _load_job
from rlfleet.controller.config import JobConfig, TrainerConfig
from rlfleet.controller.config_names import FOREIGN, ONLY_FOR, short_reason

pytestmark = pytest.mark.timeout(60)

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_grpo.yaml"


def _error(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        _load_job(TINY, list(overrides))
    return caught.value


def _field(dotted: str) -> object:
    """The field at ``dotted`` in a job (a tagged section: in any of its variants), or None."""
    owners: list[type] = [JobConfig]
    info = None
    for part in dotted.split("."):
        found = [o.model_fields[part] for o in owners if part in o.model_fields]  # type: ignore[attr-defined]
        if not found:
            return None
        info = found[0]
        owners = [c for f in found for c in (section_class(f.annotation), *union_members(f.annotation)) if c]
    return info


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_every_foreign_name_points_at_a_real_key(name: str) -> None:
    place = FOREIGN[name][0]
    assert _field(place) is not None, f"{name} -> {place}: no such key"


@pytest.mark.parametrize(
    ("override", "path", "suggestion", "whose"),
    [
        ("num_generations=8", "num_generations", "'group_size'", "TRL's"),
        ("report_to=[wandb]", "report_to", "'loggers'", "TRL's"),
        ("max_completion_length=64", "max_completion_length", "'max_response_length'", "TRL's"),
        ("per_device_train_batch_size=4", "per_device_train_batch_size", "'micro_batch_size'", "TRL's"),
        ("num_train_epochs=2", "num_train_epochs", "'num_epochs'", "TRL's"),
        ("init_kl_coef=0.01", "init_kl_coef", "'kl_coef'", "OpenRLHF's"),
        ("n_samples_per_prompt=8", "n_samples_per_prompt", "'group_size'", "OpenRLHF's"),
        ("actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.n", "'group_size'", "verl's"),
        ("actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.lr", "'learning_rate'",
         "verl's"),
        ("data.train_batch_size=32", "data.train_batch_size", "'rollout_batch_size'", "verl's"),
        ("algorithm.adv_estimator=grpo", "algorithm.adv_estimator", "'algorithm.name'", "verl's"),
        ("trainer.total_epochs=3", "trainer.total_epochs", "'num_epochs'", "verl's"),
    ],
)  # fmt: skip
def test_a_foreign_name_gets_rlfleets_in_one_line(
    override: str, path: str, suggestion: str, whose: str
) -> None:
    error = _error(override)
    assert error.path == path
    assert f"did you mean {suggestion}?" in error.reason and whose in error.reason, error.reason
    assert "known fields" not in str(error) and "\n" not in str(error)


def test_a_library_config_names_a_foreign_key_too() -> None:
    with pytest.raises(ValidationError, match=r"num_generations\n  unknown field; did you mean 'group_size'"):
        TrainerConfig(num_generations=8)  # type: ignore[call-arg]


def test_a_typo_gets_its_did_you_mean_alone_and_nothing_close_a_pointer() -> None:
    typo = _error("learning_rat=1e-5")
    assert typo.reason == "unknown field; did you mean 'learning_rate'?"
    far = _error("zzzz=1")
    assert far.reason == "unknown field (rlfleet config --fields lists every key)"
    nested = _error("update.learnig_rate=1")
    assert "did you mean" in nested.reason and "known fields" not in nested.reason


def test_the_loaders_list_is_cut_and_its_count_of_other_problems_kept() -> None:
    reason = "unknown field; did you mean 'x'? known fields: a, b, c (and 1 more problem(s): y)"
    assert short_reason(reason) == "unknown field; did you mean 'x'? (and 1 more problem(s): y)"
    assert short_reason("Field required") == "Field required"


def test_a_check_of_the_whole_config_names_its_setting_not_the_whole_config() -> None:
    error = _error("launcher.address=ray://x:10001")
    assert (error.path, error.value) == ("launcher.address", "ray://x:10001")
    assert len(str(error)) < 200, str(error)


@pytest.mark.parametrize(
    ("overrides", "path", "needle"),
    [
        (["beta=0.04"], "algorithm.beta", "has no effect under grpo: it is DPO's inverse temperature; the KL "
         "weight of grpo is kl_coef"),
        (["algorithm.beta=0.0"], "algorithm.beta", "kl_coef"),  # refused before its own bound (> 0) is
        (["algorithm=rloo", "algorithm.lam=0.9"], "algorithm.lam", "has no effect under rloo"),
        (["algorithm.gamma=0.99"], "algorithm.gamma", "has no effect under grpo"),
        (["critic_model_name=tiny:digits"], "critic_model_name", "grpo trains no critic"),
        (["algorithm.value_clip=0.5"], "algorithm.value_clip", "update.clip_eps"),
        (["algorithm=dpo", "kl_coef=0.2"], "update.kl_coef", "dpo's KL weight is algorithm.beta"),
    ],
)  # fmt: skip
def test_a_setting_the_algorithm_does_not_read_is_refused_naming_the_one_that_does(
    overrides: list[str], path: str, needle: str
) -> None:
    with pytest.warns(FutureWarning) if overrides[0].startswith("beta") else _nothing():
        error = _error(*overrides)
    assert error.path == path and needle in error.reason, str(error)


class _nothing:
    def __enter__(self) -> None: ...
    def __exit__(self, *args: object) -> None: ...


def test_settings_of_the_algorithm_in_force_or_at_their_defaults_load() -> None:
    assert load_config(JobConfig, TINY, ["algorithm=dpo", "algorithm.beta=0.2"]).algorithm.beta == 0.2
    assert load_config(JobConfig, TINY, ["algorithm=ppo", "algorithm.lam=0.9"]).algorithm.lam == 0.9
    assert load_config(JobConfig, TINY, ["algorithm.beta=0.1"]).algorithm.beta == 0.1  # the default: inert
    # a library config leaves the algorithm to its trainer class (DPOTrainer makes it dpo) until named
    assert TrainerConfig(algorithm={"beta": 0.3}).algorithm.beta == 0.3
    with pytest.raises(ValidationError, match="has no effect under grpo"):
        TrainerConfig(algorithm={"name": "grpo", "beta": 0.3})


def test_every_rule_names_a_real_setting() -> None:
    for rule in ONLY_FOR:
        assert _field(".".join(rule.path)) is not None, rule.path
