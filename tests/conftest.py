"""Fixtures shared by every test package: a real nats-server on a free port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    """A nats-server (JetStream on) for the whole session; stops exactly its own pid afterwards."""
    with EmbeddedNats() as server:
        yield server
