"""Named rollout pools in TrainerConfig (``rollout.pools``), and the rollout workers an embedded run
starts for them."""

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
    cfg = TrainerConfig(rollout={"pools": POOLS, "engine": "vllm", "max_batch_size": 32})
    assert cfg.pool_sizes() == {"small": 1, "fleet": 2}
    specs = _specs(cfg)
    assert [s.worker_id for s in specs] == ["rollout-small-0", "rollout-fleet-0", "rollout-fleet-1"]
    # what each worker process parses from the file the launcher writes
    workers = [
        RolloutWorkerConfig(**yaml.safe_load(yaml.safe_dump(s.config_data("nats://x:1")))) for s in specs
    ]
    assert [(w.pool, w.rollout.engine.type, w.rollout.max_batch_size) for w in workers] == [
        ("small", "hf", 8), ("fleet", "vllm", 32), ("fleet", "vllm", 32),
    ]  # fmt: skip
    assert len({w.placement.seed for w in workers}) == 3 and {w.fleet.cluster for w in workers} == {"c1"}
    assert [w.worker_id for w in workers] == [s.worker_id for s in specs]
    assert [w.rollout for w in workers] == [
        settings for size, settings in cfg.pools().values() for _ in range(size)
    ]


def test_a_pool_keeps_its_yaml_shape_and_declares_no_engine_setting() -> None:
    cfg = TrainerConfig(rollout={"pools": POOLS})
    assert set(type(cfg.rollout.pools["small"]).model_fields) == {"workers", "overrides"}
    assert cfg.rollout.pools["small"].overrides == {"engine": {"type": "hf"}, "max_batch_size": 8}
    assert cfg.model_dump()["rollout"]["pools"] == {
        **POOLS,
        "small": {**POOLS["small"], "engine": {"type": "hf"}},
    }
    assert cfg.rollout.workers == 3  # the pools' total, so a dumped config (both written) loads back
    again = TrainerConfig.model_validate(yaml.safe_load(dump_config(cfg)))
    assert again.rollout.pools == cfg.rollout.pools and again == cfg


def test_without_pools_one_default_pool_of_rollout_workers() -> None:
    cfg = TrainerConfig(rollout={"workers": 2})
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
        (
            {"ok": {"engine": "tgi"}},
            "engine = {'type': 'tgi'}: Input tag 'tgi' .* expected tags: 'hf', 'vllm', 'auto'",
        ),
        (
            {"ok": {"replicas": 2}},
            r"unknown rollout setting\(s\) \['replicas'\]; a pool takes workers and any of",
        ),
    ],
)
def test_bad_pools_are_refused_by_name(pools: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainerConfig(rollout={"pools": pools})


def test_rollout_workers_must_agree_with_the_pools() -> None:
    with pytest.raises(ValidationError, match=r"rollout.workers \(2\) differs from .* rollout.pools \(3\)"):
        TrainerConfig(rollout={"workers": 2, "pools": POOLS})
    assert TrainerConfig(rollout={"workers": 3, "pools": POOLS}).pool_sizes() == {"small": 1, "fleet": 2}
    with pytest.warns(
        FutureWarning, match="num_rollout_workers -> rollout.workers, rollout_pools -> rollout.pools"
    ):
        old = TrainerConfig(num_rollout_workers=3, rollout_pools=POOLS)  # the previous release's keys
    assert old == TrainerConfig(rollout={"workers": 3, "pools": POOLS})


def test_a_job_file_names_pools_and_a_rollout_fn(tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "model: tiny:digits\nreward: 'charset:allowed=0123456789'\ndata: {path: d.jsonl}\n"
        "rollout_fn: my_routes:by_length\n"
        "rollout:\n  pools:\n    small: {workers: 1, engine: hf}\n    fleet: {workers: 2}\n"
    )
    job = load_config(JobConfig, job_file, ["rollout.pools.fleet.workers=3"])
    assert job.rollout_fn == "my_routes:by_length"
    config = job.trainer_config()
    assert config.pool_sizes() == {"small": 1, "fleet": 3}
    assert config.pools()["small"][1].engine.type == "hf"


def test_dpo_jobs_take_no_rollout_fn(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="rollout_fn routes rollouts; algorithm dpo generates none"):
        JobConfig(model="tiny:digits", data={"path": "p.jsonl"}, algorithm="dpo", rollout_fn="m:f")
