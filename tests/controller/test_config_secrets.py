"""The run's config never shows a secret: its masked dump hides the NATS login (in the URL and in
``nats_auth``) and the reward tenant's token."""

from __future__ import annotations

import json

from rlfleet.controller.config import TrainerConfig


def test_the_masked_dump_hides_logins_and_tokens() -> None:
    config = TrainerConfig(nats_url="nats://u:hunter2@h:4222", nats_auth={"user": "u", "password": "hunter2"},
                           reward_token="tenant-tok")  # fmt: skip
    dumped = json.dumps(config.masked_dump())
    assert "hunter2" not in dumped and "tenant-tok" not in dumped and "nats://u:***@h:4222" in dumped
    assert config.masked_dump()["nats_auth"]["password"] == "***"
    assert "hunter2" not in repr(config.nats_auth)
