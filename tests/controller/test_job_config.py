"""TrainerConfig / JobConfig validation, every example config, ``rlfleet config`` with overrides, and
the previous release's flat form (loads with a FutureWarning, except the documented short forms)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.config import dump_config, load_config
from rlfleet.common.schema.rollout import VLLMEngineSettings
from rlfleet.controller import cli
from rlfleet.controller.config import AdaptiveKL, FixedKL, JobConfig, TrainerConfig
from rlfleet.controller.launcher_settings import EmbeddedLauncher, RayLauncher

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml")) + sorted((REPO / "deploy").glob("**/*.yaml"))
JOB_FILES = [path for path in EXAMPLES if "model:" in path.read_text()]
TINY = REPO / "examples" / "tiny_grpo.yaml"


def test_the_examples_are_there() -> None:
    names = {path.name for path in JOB_FILES}
    assert {"tiny_grpo.yaml", "smollm2_concise.yaml"} <= names


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_example_job_loads_and_its_data_exists(path: Path) -> None:
    job = load_config(JobConfig, path)
    config = job.trainer_config()
    sections = {"model", "reward"}  # the job's hold the model's name and the reward's spec besides
    assert config.model_dump(exclude=sections) == job.model_dump(
        include=set(TrainerConfig.model_fields) - sections
    )
    assert config.model == job.model.settings() and config.model.model_dump() == job.model.model_dump(
        exclude={"name"}
    )
    assert config.reward == job.reward.settings() and config.reward.model_dump() == job.reward.model_dump(
        exclude={"spec"}
    )
    resolved = cli._load_job(path, [])
    if not Path(job.data.path).is_absolute():  # absolute: a volume on the cluster (deploy/kuberay)
        assert Path(resolved.data.path).is_file(), f"{path.name}: data file {job.data.path} is missing"
    assert job.batch.rollout_batch_size % job.batch.train_batch_size == 0


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"rollout_batch_size": 16, "train_batch_size": 6}, "must be a multiple of train_batch_size"),
        ({"group_size": 1}, "greater than or equal to 2"),
        ({"kl_coef": -0.1}, "greater than or equal to 0"),
        ({"loggers": ["console", "mlflow"]}, "console"),
        ({"learning_rte": 1e-5}, "Extra inputs are not permitted"),
    ],
)
def test_trainer_config_rejects_bad_settings(settings: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        TrainerConfig(**settings)


def test_trainer_config_validates_assignments() -> None:
    config = TrainerConfig()
    with pytest.raises(ValidationError):
        config.update.temperature = 0.0
    with pytest.raises(ValidationError):
        config.batch = {"rollout_batch_size": 16, "train_batch_size": 6}  # type: ignore[assignment]


def test_job_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'rollout\.engine' = \{'type': 'sglang'\}.*'hf', 'vllm', 'auto'"):
        load_config(JobConfig, TINY, ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match=r"'max_step'.*did you mean 'max_steps'"):
        load_config(JobConfig, TINY, ["max_step=3"])
    no_model = tmp_path / "job.yaml"
    no_model.write_text("reward: concise\ndata: {path: x.jsonl}\n")
    with pytest.raises(ConfigError, match="'model'"):
        load_config(JobConfig, no_model)


def test_overrides_reach_nested_and_top_level_fields() -> None:
    overrides = ["rollout.engine.type=vllm", "learning_rate=1e-4", "max_prompt_length=64",
                 "rollout.engine.max_model_len=80", "update.weight_decay=0.1"]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # learning_rate: a documented short form of update.learning_rate
        job = load_config(JobConfig, TINY, overrides)
    assert (job.rollout.engine.type, job.update.learning_rate, job.max_prompt_length) == ("vllm", 1e-4, 64)
    assert job.update.weight_decay == 0.1
    engine = job.trainer_config().rollout.engine
    assert isinstance(engine, VLLMEngineSettings) and (engine.type, engine.max_model_len) == ("vllm", 80)


def test_moved_keys_are_refused_with_their_new_place() -> None:
    with pytest.raises(ConfigError, match=r"'data.max_prompt_length'.*unknown field"):
        load_config(JobConfig, TINY, ["data.max_prompt_length=64"])
    with pytest.raises(ConfigError, match=r"'rollout_max_cache_len'.*unknown field"):
        load_config(JobConfig, TINY, ["rollout_max_cache_len=1024"])


def test_cli_config_prints_the_resolved_job(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", str(TINY), "rollout.engine=hf", "max_steps=3", "rollout.top_p=0.9"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["rollout"]["engine"] == {"type": "hf"} and shown["rollout"]["top_p"] == 0.9
    assert shown["max_steps"] == 3 and shown["model"]["name"] == "tiny:digits"
    assert shown["update"]["learning_rate"] == 0.003 and shown["algorithm"]["name"] == "grpo"
    assert Path(shown["data"]["path"]).is_file()
    again = load_config(JobConfig, data=shown)  # what it prints is a job file in the nested form
    assert again == cli._load_job(TINY, ["rollout.engine=hf", "max_steps=3", "rollout.top_p=0.9"])


def test_cli_reports_a_bad_override_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", str(TINY), "rollout.engine=sglang"]) == 2
    assert "rollout.engine" in capsys.readouterr().err
    assert cli.main(["config", str(TINY), "nodots"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


FLAT_JOB = {  # a job of the previous release, every setting at the top
    "model": "tiny:digits", "reward": "charset:allowed=0123456789", "data": {"path": "d.jsonl"},
    "algorithm": "ppo", "learning_rate": 1e-5, "kl_coef": 0.1, "rollout_batch_size": 8, "train_batch_size": 4,
    "device": "cpu", "seed": 3, "nats_url": "nats://h:4222",  # the short forms
    "mixed_precision": "none", "lam": 0.9, "eval_data": "held.jsonl", "eval_every": 2, "reward_endpoint": "e",
    "kl_ctrl": "adaptive", "kl_target": 0.5, "num_rollout_workers": 2, "launcher": "ray", "ray_num_cpus": 4,
    "rollout": {"engine": "vllm", "max_cache_len": 1024},
}  # fmt: skip
NESTED_JOB = {
    "model": {"name": "tiny:digits", "mixed_precision": "none"},
    "reward": {"spec": "charset:allowed=0123456789", "endpoint": "e"}, "data": {"path": "d.jsonl"},
    "algorithm": {"name": "ppo", "lam": 0.9}, "update": {"learning_rate": 1e-5, "kl_coef": 0.1},
    "batch": {"rollout_batch_size": 8, "train_batch_size": 4}, "placement": {"device": "cpu", "seed": 3},
    "fleet": {"nats_url": "nats://h:4222"}, "eval": {"data": "held.jsonl", "every": 2},
    "kl": {"type": "adaptive", "target": 0.5}, "launcher": {"type": "ray", "num_cpus": 4},
    "rollout": {"workers": 2, "engine": {"type": "vllm", "max_model_len": 1024}},
}  # fmt: skip
MOVED = {  # each deprecated key of FLAT_JOB, and its place as the warning names it
    "mixed_precision": "model.mixed_precision", "lam": "algorithm.lam", "eval_data": "eval.data",
    "eval_every": "eval.every", "reward_endpoint": "reward.endpoint", "kl_ctrl": "kl.type",
    "kl_target": "kl.target", "num_rollout_workers": "rollout.workers", "ray_num_cpus": "launcher.num_cpus",
}  # fmt: skip


def test_the_previous_flat_form_loads_with_a_warning_naming_each_new_place() -> None:
    nested = JobConfig.model_validate(NESTED_JOB)
    with pytest.warns(FutureWarning, match="the flat form.* is deprecated") as caught:
        flat = JobConfig.model_validate(FLAT_JOB)
    said = " ".join(str(w.message) for w in caught)
    for key, place in MOVED.items():
        assert f"{key} -> {place}" in said, (key, said)
    for short in ("learning_rate", "kl_coef", "rollout_batch_size", "device", "seed", "nats_url"):
        assert f"{short} ->" not in said  # documented short forms are not deprecated
    assert "max_cache_len -> engine.max_model_len" in said  # the rollout section's own flat form
    assert flat == nested
    assert (flat.update.learning_rate, flat.placement.seed, flat.rollout.workers) == (1e-5, 3, 2)


def test_the_short_forms_load_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = TrainerConfig(learning_rate=1e-5, kl_coef=0.2, rollout_batch_size=8, train_batch_size=4,
                               group_size=2, device="cpu", seed=7, nats_url="nats://h:4222")  # fmt: skip
        job = load_config(JobConfig, TINY, ["learning_rate=1e-4", "seed=5", "device=cpu", "kl_coef=0.3"])
    assert (config.update.learning_rate, config.update.kl_coef) == (1e-5, 0.2)
    batch, placement = config.batch, config.placement
    assert (batch.rollout_batch_size, batch.train_batch_size, batch.group_size) == (8, 4, 2)
    assert (placement.device, placement.seed, config.fleet.nats_url) == ("cpu", 7, "nats://h:4222")
    assert (job.update.learning_rate, job.placement.seed, job.placement.device, job.update.kl_coef) == (
        1e-4, 5, "cpu", 0.3,
    )  # fmt: skip


def test_the_old_ray_launcher_keys_equal_the_tagged_section() -> None:
    with pytest.warns(FutureWarning, match="ray_num_cpus -> launcher.num_cpus"):
        old = TrainerConfig.model_validate({"launcher": "ray", "ray_num_cpus": 4})
    new = TrainerConfig.model_validate({"launcher": {"type": "ray", "num_cpus": 4}})
    assert old == new and isinstance(new.launcher, RayLauncher) and new.launcher.num_cpus == 4
    assert TrainerConfig(launcher="ray").launcher == RayLauncher(type="ray")  # the tag alone
    assert TrainerConfig(launcher={"gpus": [0]}).launcher == EmbeddedLauncher(type="embedded", gpus=[0])
    with pytest.raises(ValidationError, match="launcher.num_cpus: only used with launcher=ray"):
        TrainerConfig(launcher={"num_cpus": 4})


def test_a_kl_section_without_a_type_is_fixed() -> None:
    assert TrainerConfig(kl={}).kl == FixedKL(type="fixed")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        TrainerConfig(kl={"target": 0.5})  # a fixed controller has no target: say adaptive
    with pytest.warns(FutureWarning, match="kl_ctrl -> kl.type, kl_target -> kl.target"):
        old = TrainerConfig.model_validate({"kl_ctrl": "adaptive", "kl_target": 0.5, "kl_coef": 0.1})
    assert old.kl == AdaptiveKL(type="adaptive", target=0.5) and old.update.kl_coef == 0.1


def test_a_jobs_saved_config_loads_back_to_an_equal_config(tmp_path: Path) -> None:
    pools = ["rollout.pools.small.workers=1", "rollout.pools.small.max_batch_size=4",
             "rollout.pools.big.workers=2", "rollout.scale={3: {big: 1}}", "kl.type=scheduled",
             "kl.total_steps=100", "launcher.gpus=[0]"]  # fmt: skip
    for overrides in ([], pools):
        job = cli._load_job(TINY, overrides)
        saved = tmp_path / "config.yaml"
        saved.write_text(yaml.safe_dump(job.masked_dump(), sort_keys=False))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the nested form
            assert load_config(JobConfig, saved) == job
        saved.write_text(dump_config(job))
        assert load_config(JobConfig, saved) == job
