"""PPOTrainer and DPOTrainer against in-memory fleets: what they start, what each step sends, the KL
controller between steps, and the DPO batch that travels through the controller's own TensorStore."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.common.schema.config import load_config
from rlfleet.common.schema.trainer import ModelSettings, StepSettings, TrainerWorkerConfig
from rlfleet.controller import DPOTrainer, GRPOTrainer, PPOTrainer, TrainerConfig
from rlfleet.controller.cli import build_trainer
from rlfleet.controller.config import JobConfig
from rlfleet.controller.models import resolve_model
from rlfleet.controller.online import OnlineTrainer
from rlfleet.controller.trainer_base import TrainerBase
from rlfleet.controller.worker_configs import tier_counts

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "examples" / "data" / "tiny_digits.jsonl"
PAIRS = REPO / "examples" / "data" / "tiny_prefs.jsonl"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("tiny:digits", cache_dir=tmp_path_factory.mktemp("models"))


def _config(tmp_path: Path, **kwargs: Any) -> TrainerConfig:
    base = {"rollout_batch_size": 4, "train_batch_size": 2, "group_size": 2, "output_dir": str(tmp_path),
            "loggers": ["jsonl"], "sample_table_size": 0, "max_prompt_length": 32,
            "max_response_length": 8}  # fmt: skip
    return TrainerConfig(**{**base, **kwargs})


def test_ppo_steps_send_ppo_and_an_adaptive_kl_coefficient(
    model_dir: Path, tmp_path: Path, fake_fleet, attach_fleet
) -> None:
    config = _config(tmp_path, kl_coef=0.1, kl={"type": "adaptive", "target": 0.5, "horizon": 80})
    trainer = PPOTrainer(actor_model_name=str(model_dir), reward_model_name=str(tmp_path),
                         dataset=str(PROMPTS), config=config, critic_model_name=str(model_dir))  # fmt: skip
    assert trainer.reward_spec == {"components": [{"name": "rm", "args": {"path": str(tmp_path.resolve())}}]}
    (spec,) = [s for s in trainer.fleet_run.worker_specs() if s.tier == "trainer"]
    worker = spec.config
    assert isinstance(worker, TrainerWorkerConfig)
    assert worker.step.algorithm.name == "ppo" and worker.critic_model_path == str(model_dir)
    assert worker.step.algorithm.lam == 0.95 and worker.step.algorithm.kl_mode is None
    assert worker.step == StepSettings.of(trainer.config) and worker.model == trainer.config.model
    configure = trainer.fleet_run.trainer_configure()
    assert configure.critic and configure.model == ModelSettings() and configure.model_fingerprint
    fleet = attach_fleet(trainer, fake_fleet(kl=1.0))
    results = []
    for result in trainer.steps(num_epochs=1, max_steps=3):
        results.append(result)
        if result.step == 2:
            trainer.kl_coef = 0.05  # overrides the controller; it adapts on from there
    trainer.close()
    sent = [r.settings.update.kl_coef for r in fleet.train_requests]
    # kl 1.0 vs target 0.5: err clipped to 0.2; 8 samples per step; horizon 80 -> x1.02 per step
    assert sent == pytest.approx([0.1, 0.102, 0.05])
    assert [r.metrics["kl_coef"] for r in results] == pytest.approx(sent)
    assert {r.settings.algorithm.name for r in fleet.train_requests} == {"ppo"}
    assert {r.settings.batch.num_updates for r in fleet.train_requests} == {2}
    assert trainer.kl_coef == pytest.approx(0.051)


def test_dpo_starts_only_a_trainer_and_ships_pairs_through_its_own_store(
    model_dir: Path, tmp_path: Path, fake_fleet
) -> None:
    trainer = DPOTrainer(str(model_dir), str(PAIRS), _config(tmp_path, algorithm={"beta": 0.2}))
    assert trainer.config.algorithm.name == "dpo" and tier_counts(trainer.config, online=False) == {
        "trainer": 1
    }
    specs = trainer.fleet_run.worker_specs()
    assert [s.tier for s in specs] == ["trainer"]
    assert isinstance(specs[0].config, TrainerWorkerConfig) and specs[0].config.step.algorithm.beta == 0.2
    assert not hasattr(trainer, "set_reward_fn") and not hasattr(trainer, "set_rollout_fn")
    assert trainer.fleet_run.trainer_configure().critic is False  # DPO is configured too
    fleet = fake_fleet(kl=1.0)
    trainer.fleet_run._fleet = fleet  # type: ignore[assignment]  # start() sees a fleet, starts nothing
    results = list(trainer.steps(num_epochs=1, max_steps=2))
    store = trainer.fleet_run.store.server
    assert store is not None and store.keys == []  # each step's batch is dropped once trained on
    trainer.close()
    assert [r.step for r in results] == [1, 2] and trainer.fleet_run.store.server is None
    sent = [(r.settings.algorithm.name, len(r.scores), r.settings.batch.num_updates,
             r.settings.algorithm.beta) for r in fleet.train_requests]  # fmt: skip
    assert sent == [("dpo", 0, 2, 0.2)] * 2
    batch = fleet.fetched[0]
    assert set(batch) == {
        "prompt_ids",
        "prompt_mask",
        "chosen_ids",
        "chosen_mask",
        "rejected_ids",
        "rejected_mask",
    }
    assert batch["prompt_ids"].shape[0] == 4 and bool((batch["chosen_mask"].sum(-1) > 0).all())


def test_the_cli_picks_the_trainer_by_algorithm(model_dir: Path, tmp_path: Path) -> None:
    common = {"model": str(model_dir), "output_dir": str(tmp_path), "loggers": ["jsonl"]}
    dpo = JobConfig(**common, algorithm={"name": "dpo", "beta": 0.3}, data={"path": str(PAIRS)})
    ppo = JobConfig(
        **common, algorithm="ppo", data={"path": str(PROMPTS)}, reward="charset:allowed=0123456789"
    )
    rloo = JobConfig(
        **common, algorithm="rloo", data={"path": str(PROMPTS)}, reward="charset:allowed=0123456789"
    )
    built = [build_trainer(job) for job in (dpo, ppo, rloo)]
    assert [type(t) for t in built] == [DPOTrainer, PPOTrainer, GRPOTrainer]
    assert built[1].critic_model_path == built[1].model_path  # the critic starts from the actor
    trainer_config = built[2].fleet_run.worker_specs()[0].config
    assert isinstance(trainer_config, TrainerWorkerConfig) and trainer_config.step.algorithm.name == "rloo"
    assert built[0].config.algorithm.beta == 0.3 and built[1].config.algorithm.name == "ppo"
    for trainer in built:
        trainer.close()


def test_each_trainer_has_one_base_and_ppo_is_not_a_grpo_trainer() -> None:
    assert [c.__bases__ for c in (GRPOTrainer, PPOTrainer, DPOTrainer, OnlineTrainer)] == [
        (OnlineTrainer,), (OnlineTrainer,), (TrainerBase,), (TrainerBase,),
    ]  # fmt: skip
    assert not issubclass(PPOTrainer, GRPOTrainer)


def test_a_runs_config_yaml_is_the_job_in_its_nested_form(model_dir: Path, tmp_path: Path) -> None:
    pools = {"small": {"workers": 1, "max_batch_size": 4}, "big": {"workers": 2}}
    job = JobConfig(model=str(model_dir), data={"path": str(PROMPTS)}, reward="charset:allowed=0123456789",
                    output_dir=str(tmp_path), loggers=["jsonl"], kl={"type": "scheduled", "total_steps": 50},
                    rollout={"pools": pools}, algorithm={"name": "rloo", "kl_mode": "loss"})  # fmt: skip
    trainer = build_trainer(job)
    saved = yaml.safe_load(trainer.fleet_run.resolved_config_yaml())
    trainer.close()
    assert Path(saved.pop("model_path")) == model_dir and Path(saved.pop("dataset")) == PROMPTS
    assert (
        saved["model"]["name"] == str(model_dir) and saved["reward"]["spec"] == "charset:allowed=0123456789"
    )
    assert saved["rollout"]["pools"] == pools and saved["kl"]["type"] == "scheduled"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the nested form: no key of the previous release's
        again = load_config(JobConfig, data={**saved, "data": job.data.model_dump()})
    assert again == job  # run again as it was
