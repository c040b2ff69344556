"""TrainerConfig / JobConfig validation, every example config, and ``rlfleet config`` with overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.config import load_config
from rlfleet.controller import cli
from rlfleet.controller.config import JobConfig, TrainerConfig

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
    assert job.trainer_config().model_dump() == job.model_dump(include=set(TrainerConfig.model_fields))
    resolved = cli._load_job(path, [])
    if not Path(job.data.path).is_absolute():  # absolute: a volume on the cluster (deploy/kuberay)
        assert Path(resolved.data.path).is_file(), f"{path.name}: data file {job.data.path} is missing"
    assert job.rollout_batch_size % job.train_batch_size == 0


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
        config.temperature = 0.0


def test_job_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'rollout\.engine' = 'sglang'"):
        load_config(JobConfig, TINY, ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match=r"'max_step'.*did you mean 'max_steps'"):
        load_config(JobConfig, TINY, ["max_step=3"])
    no_model = tmp_path / "job.yaml"
    no_model.write_text("reward: concise\ndata: {path: x.jsonl}\n")
    with pytest.raises(ConfigError, match="'model'"):
        load_config(JobConfig, no_model)


def test_overrides_reach_nested_and_top_level_fields() -> None:
    job = load_config(
        JobConfig,
        TINY,
        ["rollout.engine=vllm", "learning_rate=1e-4", "max_prompt_length=64", "rollout.max_cache_len=80"],
    )
    assert (job.rollout.engine, job.learning_rate, job.max_prompt_length) == ("vllm", 1e-4, 64)
    assert (job.trainer_config().rollout.engine, job.trainer_config().rollout.max_cache_len) == ("vllm", 80)


def test_moved_keys_are_refused_with_their_new_place() -> None:
    with pytest.raises(ConfigError, match=r"'data.max_prompt_length'.*unknown field"):
        load_config(JobConfig, TINY, ["data.max_prompt_length=64"])
    with pytest.raises(ConfigError, match=r"'rollout_max_cache_len'.*unknown field"):
        load_config(JobConfig, TINY, ["rollout_max_cache_len=1024"])


def test_cli_config_prints_the_resolved_job(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", str(TINY), "rollout.engine=hf", "max_steps=3", "rollout.top_p=0.9"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["rollout"]["engine"] == "hf" and shown["rollout"]["top_p"] == 0.9
    assert shown["max_steps"] == 3 and shown["model"] == "tiny:digits"
    assert Path(shown["data"]["path"]).is_file()


def test_cli_reports_a_bad_override_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", str(TINY), "rollout.engine=sglang"]) == 2
    assert "rollout.engine" in capsys.readouterr().err
    assert cli.main(["config", str(TINY), "nodots"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err
