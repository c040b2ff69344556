"""Named rollout pools in TrainerConfig, and the rollout workers an embedded run starts for them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rlfleet.common.schema.config import dump_config, load_config
from rlfleet.common.schema.rollout import RolloutWorkerConfig
from rlfleet.controller.config import JobConfig, TrainerConfig
from rlfleet.controller.launcher import WorkerSpec
from rlfleet.controller.worker_configs import worker_specs

POOLS = {"small": {"workers": 1, "engine": "hf", "max_batch_size": 8}, "fleet": {"workers": 2}}


def _specs(cfg: TrainerConfig) -> list[WorkerSpec]:
    specs = worker_specs(cfg, Path("/models/m"), "c1", online=True, reward_spec="numeric")
    return [s for s in specs if s.tier == "rollout"]


def test_pools_start_their_workers_with_their_own_settings() -> None:
    cfg = TrainerConfig(rollout_pools=POOLS, rollout={"engine": "vllm", "max_batch_size": 32})
    assert cfg.pool_sizes() == {"small": 1, "fleet": 2}
    specs = _specs(cfg)
    assert [s.worker_id for s in specs] == ["rollout-small-0", "rollout-fleet-0", "rollout-fleet-1"]
    # what each worker process parses from the file the launcher writes
    workers = [
        RolloutWorkerConfig(**yaml.safe_load(yaml.safe_dump(s.config_data("nats://x:1")))) for s in specs
    ]
    assert [(w.pool, w.engine, w.max_batch_size) for w in workers] == [
        ("small", "hf", 8), ("fleet", "vllm", 32), ("fleet", "vllm", 32),
    ]  # fmt: skip
    assert len({w.seed for w in workers}) == 3 and {w.cluster for w in workers} == {"c1"}
    assert [w.worker_id for w in workers] == [s.worker_id for s in specs]


def test_a_pool_keeps_its_yaml_shape_and_declares_no_engine_setting() -> None:
    cfg = TrainerConfig(rollout_pools=POOLS)
    assert set(type(cfg.rollout_pools["small"]).model_fields) == {"workers", "overrides"}
    assert cfg.rollout_pools["small"].overrides == {"engine": "hf", "max_batch_size": 8}
    assert cfg.model_dump()["rollout_pools"] == POOLS  # written back as it was given
    again = TrainerConfig.model_validate(
        yaml.safe_load(dump_config(cfg.model_copy(update={"num_rollout_workers": 3})))
    )
    assert again.rollout_pools == cfg.rollout_pools


def test_without_pools_one_default_pool_of_num_rollout_workers() -> None:
    cfg = TrainerConfig(num_rollout_workers=2)
    assert cfg.pool_sizes() == {"default": 2}
    assert [(s.worker_id, s.config.pool) for s in _specs(cfg)] == [
        ("rollout-0", "default"), ("rollout-1", "default"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        ({"text": {}}, "rollout pool name 'text' is reserved"),
        ({"any": {}}, "rollout pool name 'any' is reserved"),
        ({"a.b": {}}, r"rollout pool name 'a.b': use 1-64 letters"),
        ({"ok": {"workers": 0}}, "greater than or equal to 1"),
        ({"ok": {"engine": "tgi"}}, "engine = 'tgi': Input should be 'hf', 'vllm' or 'auto'"),
        (
            {"ok": {"replicas": 2}},
            r"unknown rollout setting\(s\) \['replicas'\]; a pool takes workers and any of",
        ),
    ],
)
def test_bad_pools_are_refused_by_name(pools: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainerConfig(rollout_pools=pools)


def test_num_rollout_workers_must_agree_with_the_pools() -> None:
    with pytest.raises(
        ValidationError, match=r"num_rollout_workers \(2\) differs from .* rollout_pools \(3\)"
    ):
        TrainerConfig(num_rollout_workers=2, rollout_pools=POOLS)
    assert TrainerConfig(num_rollout_workers=3, rollout_pools=POOLS).pool_sizes() == {"small": 1, "fleet": 2}


def test_a_job_file_names_pools_and_a_rollout_fn(tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "model: tiny:digits\nreward: 'charset:allowed=0123456789'\ndata: {path: d.jsonl}\n"
        "rollout_fn: my_routes:by_length\n"
        "rollout_pools:\n  small: {workers: 1, engine: hf}\n  fleet: {workers: 2}\n"
    )
    job = load_config(JobConfig, job_file, ["rollout_pools.fleet.workers=3"])
    assert job.rollout_fn == "my_routes:by_length"
    config = job.trainer_config()
    assert config.pool_sizes() == {"small": 1, "fleet": 3}
    assert config.pools()["small"][1].engine == "hf"


def test_dpo_jobs_take_no_rollout_fn(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="rollout_fn routes rollouts; algorithm dpo generates none"):
        JobConfig(model="tiny:digits", data={"path": "p.jsonl"}, algorithm="dpo", rollout_fn="m:f")
