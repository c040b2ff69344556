"""A run's saved ``config.yaml`` loads and runs again unchanged (issue 35, point 3).

The text a run writes (saved_config.py, the same function FleetRun.resolved_config_yaml calls) is
loaded back with the job loader and compared with the job it came from; ``rlfleet config`` accepts
it as a subprocess; a library run's form (a TrainerConfig, a dataset object) loads too; credentials
never reach the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.config import load_config
from rlfleet.controller.config import JobConfig, TrainerConfig
from rlfleet.controller.saved_config import data_section, drop_records, saved_job

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _job(example: Path, *overrides: str) -> JobConfig:
    data = str((REPO / "examples" / "data").resolve())  # as rlfleet train resolves it, absolute
    job = load_config(JobConfig, example, list(overrides))
    if not Path(job.data.path).is_absolute():
        job.data.path = job.data.path.replace("examples/data", data)
    return job


def _saved(tmp_path: Path, job: JobConfig) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(saved_job(job.masked_dump(), model_path="/models/m", dataset=job.data.path,
                              header_path=path))  # fmt: skip
    return path


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_run_saves_a_config_that_loads_back_equal(tmp_path: Path, example: Path) -> None:
    job = _job(example)
    again = load_config(JobConfig, _saved(tmp_path, job))
    assert again.model_dump() == job.model_dump()


def test_the_saved_file_keeps_its_records_for_readers(tmp_path: Path) -> None:
    saved = yaml.safe_load(_saved(tmp_path, _job(REPO / "examples" / "tiny_grpo.yaml")).read_text())
    assert saved["model_path"] == "/models/m" and saved["dataset"].endswith("tiny_digits.jsonl")
    assert saved["model"]["name"] == "tiny:digits" and saved["data"]["path"] == saved["dataset"]


def test_rlfleet_config_accepts_a_saved_config(tmp_path: Path) -> None:
    path = _saved(tmp_path, _job(REPO / "examples" / "tiny_grpo.yaml", "max_steps=2"))
    rlfleet = Path(sys.executable).with_name("rlfleet")
    shown = subprocess.run([str(rlfleet), "config", str(path)], capture_output=True, text=True, timeout=50,
                           cwd=tmp_path)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["max_steps"] == 2


def test_credentials_are_not_saved_and_a_rerun_does_not_take_the_mask_for_one(tmp_path: Path) -> None:
    job = _job(REPO / "examples" / "tiny_grpo.yaml", "reward.token=s3cret-token",
               "fleet.nats_auth.user=u", "fleet.nats_auth.password=hunter22")  # fmt: skip
    path = _saved(tmp_path, job)
    text = path.read_text()
    assert "s3cret" not in text and "hunter22" not in text and "***" not in text
    again = load_config(JobConfig, path)
    assert again.reward.token.get_secret_value() == "" and again.fleet.nats_auth.user == "u"


def test_a_library_run_saves_a_job_file_too(tmp_path: Path) -> None:
    """What FleetRun writes for GRPOTrainer(model, reward, dataset, TrainerConfig(...)): the config
    with model.name, reward.spec, data read off the dataset, and the loop's length."""
    config = TrainerConfig(learning_rate=1e-4, group_size=4, output_dir=str(tmp_path / "out"))
    dataset = SimpleNamespace(data_path=REPO / "examples" / "data" / "tiny_digits.jsonl", prompt_key="prompt",
                              system_prompt=None, num_workers=1, overlong="filter")  # fmt: skip
    job = config.masked_dump()
    job["model"] = {"name": "tiny:digits", **job["model"]}
    job["reward"] = {**job["reward"], "spec": "concise"}
    job.update(data=data_section(dataset), num_epochs=2, max_steps=5)
    path = tmp_path / "config.yaml"
    path.write_text(saved_job(job, model_path="/m", dataset=str(dataset.data_path)))
    again = load_config(JobConfig, path)
    assert again.trainer_config().model_dump() == config.model_dump()
    ran = (again.model.name, again.reward.spec, again.num_epochs, again.max_steps)
    assert ran == ("tiny:digits", "concise", 2, 5)
    assert Path(again.data.path) == dataset.data_path.resolve()


def test_the_records_are_dropped_only_in_a_saved_config() -> None:
    assert drop_records({"model": "m", "model_path": "/m", "dataset": "d"}) == {"model": "m"}
    assert drop_records({"model_path": "/m", "dataset": "d"}) == {"model_path": "/m", "dataset": "d"}
    job = {"model": "tiny:digits", "reward": "concise", "data": {"path": "x.jsonl"}, "model_path": "/m"}
    with pytest.raises(ConfigError, match="'model_path'"):
        load_config(JobConfig, data=job)  # a job file's own model_path is no setting of a job
