"""Config in sections, and the previous release's flat form (issue 28): every worker config class
loads the flat keys a previous-release controller writes into their sections, and ``legacy_dump``
of the nested config gives that flat form back (what a previous-release worker reads). Then the
machinery of :mod:`rlfleet.common.schema.config` on small classes of its own: ``nest_legacy``,
``flatten``, short forms, tagged unions, and where the flat form warns.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
import yaml
from pydantic import Field, ValidationError

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.config import ConfigModel, Legacy, flatten, legacy_dump, load_config, nest_legacy
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.common.schema.reward import EndpointConfig, RewardWorkerConfig
from rlfleet.common.schema.rollout import (
    HFEngineSettings,
    RolloutSettings,
    RolloutWorkerConfig,
    VLLMEngineSettings,
)
from rlfleet.common.schema.trainer import (
    AlgorithmSettings,
    BatchSettings,
    ModelSettings,
    StepSettings,
    TrainerWorkerConfig,
    UpdateSettings,
)
from rlfleet.common.schema.worker import (
    FleetAddress,
    ModelLoading,
    Placement,
    ServiceConfig,
    TensorPlaneSettings,
)

URL = "nats://10.0.0.1:4222"
SERVICE = {"nats_url": URL, "cluster": "prod", "nats_auth": {"user": "rollout", "tls": True}, "device": "cpu",
           "seed": 7, "bind_host": "0.0.0.0", "advertise_host": "10.0.0.5", "tensor_tls_ca": "/ca.pem",
           "worker_id": "w-0", "pool": "long", "metrics_port": 9090}  # fmt: skip
"""A previous release's flat worker settings, as its controller writes them (defaults left out)."""


def _loads_silently(cls: type[ConfigModel], data: dict[str, Any]) -> Any:
    """``cls`` from ``data``, failing on any warning (a worker's flat form is not deprecated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return cls.model_validate(data)


def _service_sections(cfg: ServiceConfig) -> None:
    auth = NatsConnection(user="rollout", tls=True)
    assert cfg.fleet == FleetAddress(nats_url=URL, cluster="prod", nats_auth=auth)
    assert cfg.placement == Placement(device="cpu", seed=7)
    assert cfg.tensor_plane == TensorPlaneSettings(bind_host="0.0.0.0", advertise_host="10.0.0.5",
                                                   tensor_tls_ca="/ca.pem")  # fmt: skip
    assert (cfg.worker_id, cfg.pool, cfg.metrics_port) == ("w-0", "long", 9090)


# --- each worker config class: the flat form in, the flat form back -----------------------------


def test_a_service_config_of_the_previous_release_loads_into_its_sections_and_dumps_back() -> None:
    cfg = _loads_silently(ServiceConfig, SERVICE)
    _service_sections(cfg)
    assert legacy_dump(cfg) == SERVICE
    assert legacy_dump(_loads_silently(ServiceConfig, {})) == {"nats_url": "nats://127.0.0.1:4222",
                                                               "cluster": "default"}  # fmt: skip


def test_a_rollout_worker_config_of_the_previous_release_loads_into_its_sections_and_dumps_back() -> None:
    flat = {**SERVICE, "model_path": "/m", "trust_remote_code": True, "engine": "vllm", "dtype": "bfloat16",
            "max_batch_size": 256, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.85,
            "enforce_eager": True, "colocate": True, "sleep_level": 2, "cache_policy": "none",
            "max_cache_len": 4096, "capacity": 2}  # fmt: skip
    cfg = _loads_silently(RolloutWorkerConfig, flat)
    _service_sections(cfg)
    assert (cfg.model_path, cfg.capacity, cfg.loading) == ("/m", 2, ModelLoading(trust_remote_code=True))
    engine = VLLMEngineSettings(type="vllm", tensor_parallel_size=2, gpu_memory_utilization=0.85,
                                enforce_eager=True, colocate=True, sleep_level=2, enable_prefix_caching=False,
                                max_model_len=4096)  # fmt: skip
    assert cfg.rollout == RolloutSettings(engine=engine, dtype="bfloat16", max_batch_size=256)
    assert legacy_dump(cfg) == flat
    lru = _loads_silently(RolloutWorkerConfig, {"model_path": "/m", "engine": "auto", "cache_policy": "lru"})
    assert lru.rollout.engine == VLLMEngineSettings(type="auto", enable_prefix_caching=True)
    assert legacy_dump(lru)["engine"] == "auto" and "cache_policy" not in legacy_dump(lru)  # lru: the default
    hf = _loads_silently(RolloutWorkerConfig, {"model_path": "/m", "engine": "hf", "dtype": "float16"})
    assert hf.rollout == RolloutSettings(engine=HFEngineSettings(type="hf"), dtype="float16")
    assert legacy_dump(hf) == {"nats_url": "nats://127.0.0.1:4222", "cluster": "default", "model_path": "/m",
                               "dtype": "float16"}  # fmt: skip


def test_a_reward_worker_config_of_the_previous_release_loads_into_its_sections_and_dumps_back() -> None:
    flat = {**SERVICE, "trust_remote_code": True, "endpoints": {"e": {"spec": "concise"}},
            "max_concurrency": 8, "quota_store": "process", "state_dir": "/state"}  # fmt: skip
    cfg = _loads_silently(RewardWorkerConfig, flat)
    _service_sections(cfg)
    assert cfg.loading == ModelLoading(trust_remote_code=True)
    assert cfg.endpoints == {"e": EndpointConfig(spec="concise")} and cfg.quota_store == "process"
    assert legacy_dump(cfg) == flat


def test_a_trainer_worker_config_of_the_previous_release_loads_into_its_sections_and_dumps_back() -> None:
    flat = {**SERVICE, "model_path": "/m", "trust_remote_code": True, "param_dtype": "bfloat16",
            "sharding": "none", "learning_rate": 1e-5, "micro_batch_size": 2, "algorithm": "ppo",
            "kl_mode": "reward", "gamma": 0.99, "rollout_batch_size": 8, "train_batch_size": 4,
            "group_size": 2, "threads": 2}  # fmt: skip
    cfg = _loads_silently(TrainerWorkerConfig, flat)
    _service_sections(cfg)
    assert cfg.model == ModelSettings(trust_remote_code=True, param_dtype="bfloat16", sharding="none")
    assert cfg.step == StepSettings(
        update=UpdateSettings(learning_rate=1e-5, micro_batch_size=2),
        algorithm=AlgorithmSettings(name="ppo", kl_mode="reward", gamma=0.99),
        batch=BatchSettings(rollout_batch_size=8, train_batch_size=4, group_size=2),
    )
    assert (cfg.model_path, cfg.threads) == ("/m", 2)
    assert legacy_dump(cfg) == flat


def test_a_worker_config_file_of_either_form_loads_the_same() -> None:
    nested = {"fleet": {"nats_url": URL, "cluster": "prod", "nats_auth": {"user": "rollout", "tls": True}},
              "placement": {"device": "cpu", "seed": 7},
              "tensor_plane": {"bind_host": "0.0.0.0", "advertise_host": "10.0.0.5",
                               "tensor_tls_ca": "/ca.pem"},
              "worker_id": "w-0", "pool": "long", "metrics_port": 9090, "model_path": "/m",
              "rollout": {"engine": {"type": "vllm", "colocate": True, "max_model_len": 4096}}}  # fmt: skip
    flat = {**SERVICE, "model_path": "/m", "engine": "vllm", "colocate": True, "max_cache_len": 4096}
    assert _loads_silently(RolloutWorkerConfig, nested) == _loads_silently(RolloutWorkerConfig, flat)
    assert nest_legacy(RolloutWorkerConfig, flat) == nested


# --- the machinery ---------------------------------------------------------------------------------


def test_nest_legacy_moves_flat_keys_into_their_sections_and_the_flat_one_wins() -> None:
    data = {"fleet": {"cluster": "nested", "nats_url": URL}, "cluster": "flat", "seed": 3, "pool": "p"}
    assert nest_legacy(ServiceConfig, data) == {"fleet": {"cluster": "flat", "nats_url": URL},
                                                "placement": {"seed": 3}, "pool": "p"}  # fmt: skip
    assert data["cluster"] == "flat"  # the input is left as it was
    nested = {"fleet": {"cluster": "c"}, "placement": {"device": "cpu"}}
    assert nest_legacy(ServiceConfig, nested) == nested  # the nested form: nothing to move
    renamed = nest_legacy(RolloutSettings, {"max_cache_len": 64, "cache_policy": "none", "engine": "vllm"})
    assert renamed == {"engine": {"type": "vllm", "max_model_len": 64, "enable_prefix_caching": False}}


def test_flatten_is_the_inverse_of_nest_legacy() -> None:
    flat = {**SERVICE, "model_path": "/m", "engine": "vllm", "colocate": True, "cache_policy": "none"}
    nested = nest_legacy(RolloutWorkerConfig, flat)
    assert flatten(RolloutWorkerConfig, nested) == flat
    step = {"update": {"kl_coef": 0.1}, "algorithm": {"name": "rloo", "kl_mode": "loss"},
            "batch": {"group_size": 8}}  # fmt: skip
    flat_step = {"kl_coef": 0.1, "algorithm": "rloo", "kl_mode": "loss", "group_size": 8}
    assert flatten(StepSettings, step) == flat_step
    assert nest_legacy(StepSettings, flatten(StepSettings, step)) == step


def test_a_section_given_as_a_string_is_its_short_form() -> None:
    assert RolloutSettings(engine="vllm").engine == VLLMEngineSettings(type="vllm")
    assert RolloutSettings.model_validate({"engine": "hf"}).engine == HFEngineSettings(type="hf")
    assert RolloutSettings.model_validate({"engine": "auto"}).vllm() == VLLMEngineSettings(type="auto")
    cfg = load_config(RolloutWorkerConfig, data={"model_path": "/m"}, overrides=["rollout.engine=vllm"])
    assert cfg.rollout.engine == VLLMEngineSettings(type="vllm") and cfg.rollout.context_cap == 2048
    assert StepSettings.model_validate({"algorithm": "dpo"}).algorithm.name == "dpo"
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(RolloutWorkerConfig, data={"model_path": "/m"}, overrides=["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="placement"):  # a section without a short form takes none
        load_config(ServiceConfig, data={"placement": "cpu"})


def test_an_engine_without_its_tag_is_the_previous_default(caplog: pytest.LogCaptureFixture) -> None:
    """The previous release's flat form may omit ``engine`` (hf, its default) and still give vLLM-only
    settings (unused there): the engine is HF, and they are dropped with a warning naming them."""
    with caplog.at_level(logging.WARNING, logger="rlfleet.common.schema.rollout"):
        flat = {"model_path": "/m", "colocate": True, "max_cache_len": 512, "dtype": "float16"}
        cfg = _loads_silently(RolloutWorkerConfig, flat)
    assert cfg.rollout == RolloutSettings(engine=HFEngineSettings(type="hf"), dtype="float16")
    assert cfg.rollout.vllm() is None and cfg.rollout.context_cap is None
    assert "the HF engine has no colocate, max_model_len; ignored" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlfleet.common.schema.rollout"):
        hf = HFEngineSettings(type="hf")
        assert RolloutSettings.model_validate({"dtype": "float16"}).engine == hf
    assert "the HF engine has no" not in caplog.text
    with pytest.raises(ValueError, match="type"):  # a nested engine must name its type: no guess
        RolloutSettings.model_validate({"engine": {"sleep_level": 2}})
    with pytest.raises(ValueError, match="max_model_len"):  # the vLLM section checks its own settings
        RolloutSettings(engine={"type": "vllm", "max_model_len": 1})


class _Optim(ConfigModel):
    """An optimizer section."""

    lr: float = Field(default=1e-3, description="learning rate")
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999], description="Adam betas")


class _Local(ConfigModel):
    """A launcher variant."""

    SHORT_FORM: ClassVar[str | None] = "type"

    type: Literal["local"] = Field(description="local")


class _Remote(ConfigModel):
    """Another launcher variant."""

    SHORT_FORM: ClassVar[str | None] = "type"

    type: Literal["remote"] = Field(description="remote")
    address: str = Field(default="auto", description="where")


class _Job(ConfigModel):
    """A job whose flat form is deprecated, with a documented short form."""

    FLAT_SECTIONS: ClassVar[frozenset[str]] = frozenset({"optim", "launcher"})
    RENAMED: ClassVar[tuple[Legacy, ...]] = (
        Legacy("launcher", ("launcher", "type")), Legacy("remote_address", ("launcher", "address")),
    )  # fmt: skip
    SHORT: ClassVar[frozenset[str]] = frozenset({"lr"})
    WARN_LEGACY: ClassVar[bool] = True

    name: str = Field(default="run", description="run name")
    optim: _Optim = Field(default_factory=_Optim, description="optimizer")
    launcher: _Local | _Remote = Field(
        default_factory=lambda: _Local(type="local"), discriminator="type", description="launcher"
    )


def test_a_future_warning_names_the_new_keys_only_where_the_flat_form_is_deprecated() -> None:
    with pytest.warns(FutureWarning, match=r"_Job: the flat form is deprecated .* betas -> optim.betas"):
        job = _Job.model_validate({"betas": [0.5, 0.6], "lr": 0.1})
    assert job.optim == _Optim(lr=0.1, betas=[0.5, 0.6])
    with pytest.warns(FutureWarning) as caught:
        remote = _Job.model_validate({"launcher": "remote", "remote_address": "h:1"})
    assert remote.launcher == _Remote(type="remote", address="h:1")
    said = str(caught[0].message)  # `launcher: remote` is the section's short form, not a flat key
    assert said.endswith("write remote_address -> launcher.address")
    with warnings.catch_warnings():  # SHORT keys, the nested form and short-form sections are silent
        warnings.simplefilter("error")
        assert _Job.model_validate({"lr": 0.5}).optim.lr == 0.5
        nested = _Job.model_validate({"optim": {"betas": [0.1, 0.2]}, "launcher": "remote"})
        assert nested.launcher == _Remote(type="remote") and nested.optim.betas == [0.1, 0.2]
        assert legacy_dump(remote) == {"launcher": "remote", "remote_address": "h:1"}


def test_load_config_nests_each_layer_before_the_next_one(tmp_path: Path) -> None:
    """A nested override (a CLI flag) wins over a flat file, a flat one over a nested file."""
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump({"model_path": "/m", "cluster": "file", "nats_auth": {"user": "u"}}))
    cfg = load_config(RolloutWorkerConfig, flat, ["fleet.cluster=flag", "fleet.nats_auth.tls=true"])
    assert (cfg.fleet.cluster, cfg.fleet.nats_auth.user, cfg.fleet.nats_auth.tls) == ("flag", "u", True)
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump({"model_path": "/m", "fleet": {"cluster": "file", "nats_url": URL}}))
    cfg = load_config(RolloutWorkerConfig, nested, ["cluster=flag"])
    assert (cfg.fleet.cluster, cfg.fleet.nats_url) == ("flag", URL)
    cfg = load_config(RolloutWorkerConfig, nested, data={"device": "cpu", "cluster": "data"})
    assert (cfg.fleet.cluster, cfg.placement.device) == ("file", "cpu")  # the file over the data
    with pytest.raises(ConfigError, match="placement.device"):  # a flat key's error names its place
        load_config(RolloutWorkerConfig, nested, ["device=tpu"])


def test_the_step_settings_nest_and_flatten_themselves_as_the_loader_does() -> None:
    """What a step reads every step: its own flat form (``wire_form``, ``_sections``), which must say
    what the general loader says (``legacy_dump``, ``nest_legacy``) for a previous release's peer."""
    flat = {"learning_rate": 1e-5, "algorithm": "ppo", "gamma": 0.9, "group_size": 2, "train_batch_size": 8,
            "rollout_batch_size": 32}  # fmt: skip
    step = StepSettings.model_validate(flat)
    assert step == StepSettings.model_validate(nest_legacy(StepSettings, flat))
    assert step.wire_form() == legacy_dump(step) == flat
    assert StepSettings.model_validate(step.wire_form()) == step
    assert StepSettings().wire_form() == {}  # every default left out
    given = {"update": {"learning_rate": 2e-5, "clip_eps": 0.1}, "learning_rate": 3e-5}
    both = StepSettings.model_validate(given)
    assert (both.update.learning_rate, both.update.clip_eps) == (3e-5, 0.1)  # the flat one wins
    newer = StepSettings.model_validate({"learning_rate": 1e-4, "newer_setting": 1})  # a newer controller's
    assert newer.update.learning_rate == 1e-4
    with pytest.raises(ValidationError, match="update"):
        StepSettings.model_validate({"update": 3, "learning_rate": 1e-4})
