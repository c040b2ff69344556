"""``launcher: ray`` with an outside ``nats_url``: the workers' logins (``launcher.worker_auth``) checked
at load.

A server the controller logs in to needs a login for every tier the run starts (named when one is
missing); an open server needs none; the logins come inline or from a file, never appear in a
dumped config, take the controller's TLS settings where they leave them unset, and the URL itself
carries no login.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.config import load_config, merge
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.controller import TrainerConfig
from rlfleet.controller.launcher_settings import EmbeddedLauncher, RayLauncher, worker_logins

pytestmark = pytest.mark.timeout(30)

OUTSIDE = {"launcher": {"type": "ray"}, "fleet": {"nats_url": "nats://10.0.0.5:4222", "cluster": "prod"}}
CONTROLLER = {"user": "controller", "password": "c-secret"}
LOGINS = {tier: {"user": tier, "password": f"{tier}-secret"} for tier in ("trainer", "rollout", "reward")}


def _load(*sections: dict[str, Any]) -> TrainerConfig:
    data: dict[str, Any] = {}
    for section in sections:
        data = merge(data, section)
    return load_config(TrainerConfig, data=data)


def _auth(login: dict[str, Any]) -> dict[str, Any]:
    """The controller's login, ``fleet.nats_auth``."""
    return {"fleet": {"nats_auth": login}}


def _workers(logins: object) -> dict[str, Any]:
    """The workers' logins, ``launcher.worker_auth``."""
    return {"launcher": {"worker_auth": logins}}


def test_an_open_outside_server_needs_no_logins() -> None:
    config = _load(OUTSIDE)
    logins = worker_logins(config, config.fleet.nats_auth)
    assert sorted(logins) == ["reward", "rollout", "trainer"]
    assert all(login.env() == {} for login in logins.values())


def test_a_server_with_logins_needs_one_per_started_tier() -> None:
    with pytest.raises(ConfigError, match=r"none is given for rollout, reward: set launcher\.worker_auth"):
        _load(OUTSIDE, _auth(CONTROLLER), _workers({"trainer": LOGINS["trainer"]}))
    with pytest.raises(ConfigError, match="none is given for trainer, rollout, reward"):
        _load(OUTSIDE, _auth(CONTROLLER))
    # a login without credentials (only TLS) is no login
    with pytest.raises(ConfigError, match="none is given for reward"):
        _load(OUTSIDE, _auth(CONTROLLER), _workers({**LOGINS, "reward": {"tls": True}}))
    # only the tiers the run starts: DPO has no rollout or reward tier, reward.url scores elsewhere
    _load(OUTSIDE, _auth(CONTROLLER), {"algorithm": "dpo"}, _workers({"trainer": LOGINS["trainer"]}))
    shared = _load(OUTSIDE, _auth(CONTROLLER), {"reward": {"url": "nats://rewards:4222"}},
                   _workers({k: v for k, v in LOGINS.items() if k != "reward"}))  # fmt: skip
    assert sorted(worker_logins(shared, shared.fleet.nats_auth)) == ["rollout", "trainer"]


def test_the_controller_login_from_the_environment_is_checked_when_the_run_starts() -> None:
    config = _load(OUTSIDE)  # the controller's login not in the config: it loads
    controller = NatsConnection().resolved({"RLFLEET_NATS_USER": "controller", "RLFLEET_NATS_PASSWORD": "x"})
    with pytest.raises(ConfigError, match="none is given for trainer, rollout, reward"):
        worker_logins(config, controller)


def test_logins_are_secrets_and_tls_comes_from_the_controller() -> None:
    roles = {**LOGINS, "rollout": {**LOGINS["rollout"], "tls_ca_file": "/rollout-ca.pem"}}
    config = _load(OUTSIDE, _auth({**CONTROLLER, "tls_ca_file": "/ca.pem"}), _workers(roles))
    dumped = json.dumps(config.masked_dump())
    assert "secret" not in dumped and "secret" not in repr(config)
    assert json.loads(dumped)["launcher"]["worker_auth"]["trainer"]["password"] == "***"
    logins = worker_logins(config, config.fleet.nats_auth)
    assert logins["trainer"].env() == {"RLFLEET_NATS_USER": "trainer",
                                       "RLFLEET_NATS_PASSWORD": "trainer-secret",
                                       "RLFLEET_NATS_TLS_CA_FILE": "/ca.pem"}  # fmt: skip
    assert logins["rollout"].tls_ca_file == "/rollout-ca.pem"  # its own wins


def test_logins_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "logins.yaml"
    path.write_text(yaml.safe_dump(LOGINS))
    config = _load(OUTSIDE, _auth(CONTROLLER), _workers(str(path)))
    assert isinstance(config.launcher, RayLauncher)
    assert config.launcher.worker_auth["reward"].password.get_secret_value() == "reward-secret"
    with pytest.raises(ConfigError, match="no such config file"):
        _load(OUTSIDE, _workers(str(tmp_path / "missing.yaml")))
    path.write_text(yaml.safe_dump({"critic": LOGINS["trainer"]}))
    with pytest.raises(ConfigError, match="critic"):
        _load(OUTSIDE, _workers(str(path)))


def test_logins_need_ray_with_nats_url_and_the_url_carries_none() -> None:
    with pytest.raises(ConfigError, match="only used with nats_url"):
        _load({"launcher": {"type": "ray"}}, _workers(LOGINS))
    with pytest.raises(ConfigError, match="only used with launcher=ray"):
        _load({"fleet": {"nats_url": "nats://10.0.0.5:4222"}}, _workers(LOGINS))
    with (
        pytest.warns(FutureWarning, match="nats_worker_auth -> launcher.worker_auth"),
        pytest.raises(ConfigError, match="only used with launcher=ray"),
    ):
        _load({"nats_url": "nats://10.0.0.5:4222", "nats_worker_auth": LOGINS})  # the previous release's keys
    with pytest.raises(ConfigError, match="not in the URL") as caught:
        _load(OUTSIDE, {"fleet": {"nats_url": "nats://controller:c-secret@10.0.0.5:4222"}})
    assert "c-secret" not in str(caught.value)
    # the same URL is fine where the run starts no worker (it joins a fleet)
    joined = _load({"nats_url": "nats://controller:c-secret@10.0.0.5:4222"})
    assert joined.launcher == EmbeddedLauncher(type="embedded")
