"""The run's config never shows a secret: its masked dump hides the NATS login (in the URL and in
``fleet.nats_auth``) and the reward tenant's token (``reward.token``)."""

from __future__ import annotations

import json

from rlfleet.controller.config import TrainerConfig


def test_the_masked_dump_hides_logins_and_tokens() -> None:
    login = {"user": "u", "password": "hunter2"}
    config = TrainerConfig(nats_url="nats://u:hunter2@h:4222", fleet={"nats_auth": login},
                           reward={"token": "tenant-tok", "url": "nats://r:hunter2@r:4222"})  # fmt: skip
    dumped = json.dumps(config.masked_dump())
    assert "hunter2" not in dumped and "tenant-tok" not in dumped and "nats://u:***@h:4222" in dumped
    assert config.masked_dump()["fleet"]["nats_auth"]["password"] == "***"
    assert config.masked_dump()["reward"]["url"] == "nats://r:***@r:4222"
    assert "hunter2" not in repr(config.fleet.nats_auth) and "hunter2" not in repr(config)
