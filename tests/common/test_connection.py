"""NATS connection settings: validation, the environment, masking, what nats-py is given, the flags."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from rlfleet.common.control.nats_roles import ROLES, RunCredentials, role_permissions, server_config
from rlfleet.common.control.worker import cli_overrides, connection_from_args, parse_service_args
from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.config import dump_config, load_config
from rlfleet.common.schema.connection import NatsConnection, mask_url
from rlfleet.common.schema.rollout import RolloutWorkerConfig


def test_one_way_to_authenticate_and_a_key_with_a_cert() -> None:
    with pytest.raises(ValueError, match="set one of"):
        NatsConnection(user="a", password="b", token="c")
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file"):
        NatsConnection(tls_cert_file="/c.pem")
    with pytest.raises(ValueError, match="inbox_prefix"):
        NatsConnection(inbox_prefix="_INBOX.>")


def test_unset_fields_come_from_the_environment_and_config_wins() -> None:
    env = {"RLFLEET_NATS_USER": "rollout", "RLFLEET_NATS_PASSWORD": "pw", "RLFLEET_NATS_TLS": "true"}
    resolved = NatsConnection().resolved(env)
    assert resolved.user == "rollout" and resolved.password.get_secret_value() == "pw" and resolved.tls
    # a config that names a way to authenticate keeps it: no token + password mix from the shell
    mine = NatsConnection(token="t").resolved(env)
    assert mine.token.get_secret_value() == "t" and mine.user == "" and mine.tls
    bad = {"RLFLEET_NATS_USER": "u", "RLFLEET_NATS_TOKEN": "secret-token"}
    with pytest.raises(ConfigError) as caught:
        NatsConnection().resolved(bad)
    assert "secret-token" not in str(caught.value)


def test_secrets_are_masked_in_dumps_reprs_and_config_errors(tmp_path: Path) -> None:
    # (the controller's whole-run dump: tests/controller/test_config_secrets.py)
    auth = NatsConnection(user="u", password="hunter2")
    assert "hunter2" not in repr(auth) and "hunter2" not in dump_config(auth)
    path = tmp_path / "w.yaml"
    path.write_text("model_path: /m\nfleet: {nats_auth: {user: u, password: hunter2, token: also-secret}}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(RolloutWorkerConfig, path)
    assert "hunter2" not in str(caught.value) and "also-secret" not in str(caught.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://u:p@h:4222", "nats://u:***@h:4222"),
        ("nats://tok@h", "nats://***@h"),
        ("tls://h:4222", "tls://h:4222"),
        ("nats://a:b@h1:1,nats://h2:2", "nats://a:***@h1:1,nats://h2:2"),
    ],
)
def test_urls_lose_their_credentials(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_connect_options_carry_credentials_inbox_and_tls(tmp_path: Path) -> None:
    options = NatsConnection(user="rollout", password="pw").connect_options()
    assert options == {"inbox_prefix": "_INBOX.rollout", "user": "rollout", "password": "pw"}
    assert NatsConnection(token="t").connect_options() == {"inbox_prefix": "_INBOX", "token": "t"}
    assert isinstance(NatsConnection(tls=True).connect_options()["tls"], ssl.SSLContext)
    with pytest.raises(ConfigError, match="no such readable file"):
        NatsConnection(tls_ca_file=str(tmp_path / "missing.pem")).connect_options()
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ConfigError, match="not a usable certificate"):
        NatsConnection(tls_ca_file=str(junk)).connect_options()


def test_serve_flags_set_the_connection_but_no_secret_flag_exists() -> None:
    args = parse_service_args("rlfleet-rollout", ["serve", "--nats-user", "rollout", "--nats-ca", "/ca.pem",
                                                  "--nats-tls", "model_path=/m"])  # fmt: skip
    overrides = cli_overrides(args)
    assert "fleet.nats_auth.user=rollout" in overrides and "fleet.nats_auth.tls_ca_file=/ca.pem" in overrides
    config = load_config(RolloutWorkerConfig, None, overrides)
    assert config.fleet.nats_auth.user == "rollout" and config.fleet.nats_auth.tls
    assert connection_from_args(args).tls_ca_file == "/ca.pem"
    with pytest.raises(SystemExit):
        parse_service_args("rlfleet-rollout", ["serve", "--nats-password", "x"])


def test_every_role_has_its_own_password_and_the_config_names_them() -> None:
    first, second = RunCredentials.generate("c"), RunCredentials.generate("c")
    assert len(set(first.passwords.values())) == len(ROLES)
    assert first.passwords != second.passwords and "password" not in repr(first)
    text = server_config(first)
    assert all(password in text for password in first.passwords.values())
    assert first.env("reward")["RLFLEET_NATS_USER"] == "reward"


def test_worker_roles_publish_only_their_membership_and_answers() -> None:
    rollout = role_permissions("c", "rollout")
    assert rollout["publish"] == {"allow": ["rlfleet.c.rollout.membership", "rlfleet.c.trainer.latest",
                                            "rlfleet.c.env.reset", "rlfleet.c.env.episode.*"]}  # fmt: skip
    # environments (issue 33): a rollout worker reaches a reward worker's episodes, never its own subject
    assert not any(s.startswith("rlfleet.c.reward.") for s in rollout["publish"]["allow"])  # type: ignore[index]
    reward = role_permissions("c", "reward")
    assert "rlfleet.c.env.>" in reward["subscribe"]["allow"]  # type: ignore[index]
    assert rollout["allow_responses"] == {"max": 1, "expires": "21600s"}  # not nats-server's 2 min default
    controller = role_permissions("c", "controller")
    assert "rlfleet.c.trainer.membership" in controller["publish"]["deny"]  # type: ignore[index]
    with pytest.raises(ValueError, match="unknown role"):
        role_permissions("c", "tenant")
    with pytest.raises(ValueError):
        role_permissions("a.b", "rollout")


def test_a_connection_travels_as_environment_variables_and_reads_back() -> None:
    login = NatsConnection(user="rollout", password="pw", tls=True, tls_ca_file="/ca.pem")
    env = login.env()
    assert env == {"RLFLEET_NATS_USER": "rollout", "RLFLEET_NATS_PASSWORD": "pw", "RLFLEET_NATS_TLS": "true",
                   "RLFLEET_NATS_TLS_CA_FILE": "/ca.pem"}  # fmt: skip
    assert NatsConnection().resolved(env) == login and NatsConnection().env() == {}
    assert RunCredentials.generate("c").env("trainer")["RLFLEET_NATS_INBOX_PREFIX"] == "_INBOX.trainer"


def test_the_repr_of_a_fleet_address_hides_url_logins() -> None:
    from rlfleet.common.schema.worker import FleetAddress

    shown = repr(FleetAddress(nats_url="nats://u:pw-secret@h:4222,nats://tok-secret@g:4222"))
    assert "pw-secret" not in shown and "tok-secret" not in shown
    assert "nats://u:***@h:4222" in shown and "g:4222" in shown
