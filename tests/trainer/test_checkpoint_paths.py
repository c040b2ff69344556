"""``trainer.save`` / ``trainer.load`` stay inside the worker's checkpoint root.

A path from the wire that is absolute outside the root, holds ``..``, or leads out through a symlink
is refused with a ``forbidden`` error naming it; a load whose files link out of the root is refused
before anything is read (DCP's ``.metadata`` is a pickle). Checked on a real trainer worker on a
real nats-server; inside the root, save and load still work.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import CheckpointLoaded, LoadCheckpoint, SaveCheckpoint, Saved
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject
from rlfleet.common.errors import RemoteUserError
from rlfleet.common.schema.trainer import StepSettings, TrainerWorkerConfig, UpdateSettings
from rlfleet.common.schema.worker import FleetAddress, Placement
from rlfleet.trainer.checkpoint import confine
from rlfleet.trainer.errors import CheckpointPathRefused
from rlfleet.trainer.service import TrainerWorker

pytestmark = pytest.mark.timeout(120)


class Trainer:
    def __init__(self, client: NatsTransport, worker: TrainerWorker, root: Path) -> None:
        self.client, self.worker, self.root = client, worker, root

    async def ask(self, verb: str, message: Any) -> Any:
        target = subject(self.worker.config.fleet.cluster, "trainer", verb)
        return await self.client.request(target, message, timeout=60)

    async def refused(self, verb: str, message: Any) -> str:
        with pytest.raises(RemoteUserError) as info:
            await self.ask(verb, message)
        assert info.value.code == "forbidden", info.value
        return info.value.remote_message


@pytest.fixture
async def trainer(nats_server: EmbeddedNats, tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Trainer]:
    root = tmp_path / "root"
    root.mkdir()
    config = TrainerWorkerConfig(
        model_path=str(tiny_model_dir), worker_id="trainer-0", weights_store_mb=64, checkpoint_root=str(root),
        fleet=FleetAddress(nats_url=nats_server.url, cluster=f"c{uuid.uuid4().hex[:8]}"),
        placement=Placement(device="cpu"), step=StepSettings(update=UpdateSettings(kl_coef=0.0)),
    )  # fmt: skip
    server = await NatsTransport.connect(nats_server.url, name="trainer", tier="trainer")
    client = await NatsTransport.connect(nats_server.url, name="test", tier="controller")
    worker = TrainerWorker(config, server)
    await worker.start()
    try:
        yield Trainer(client, worker, root)
    finally:
        await worker.stop("test over")
        await client.close()
        await server.close()


def test_confine_takes_paths_inside_the_root_only(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    assert confine(root, str(root / "ok" / "ckpt")) == (root / "ok" / "ckpt").resolve()
    assert confine(root, "ok/ckpt") == (root / "ok" / "ckpt").resolve()  # relative: under the root
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    for bad, why in [
        (str(tmp_path / "outside"), "outside the checkpoint root"),
        ("/etc/passwd", "outside the checkpoint root"),
        (str(root / "ok" / ".." / ".." / "outside"), "'..'"),
        ("../outside", "'..'"),
        (str(root / "link" / "ckpt"), "symlink"),
        (str(root), "outside the checkpoint root"),  # the root itself is no checkpoint
        ("", "empty"),
        ("ok/\x00x", "NUL"),
    ]:
        with pytest.raises(CheckpointPathRefused, match=why) as info:
            confine(root, bad)
        assert repr(bad) in str(info.value) and str(root.resolve()) in str(info.value)


async def test_save_and_load_outside_the_root_are_refused(trainer: Trainer, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    (tmp_path / "escape").mkdir()
    (trainer.root / "link").symlink_to(tmp_path / "escape")
    for path in [str(outside), "/", str(trainer.root / ".." / "elsewhere"), str(trainer.root / "link" / "x")]:
        message = await trainer.refused("save", SaveCheckpoint(path=path, mode="full"))
        assert repr(path) in message
        message = await trainer.refused("load", LoadCheckpoint(path=path))
        assert repr(path) in message
    assert not outside.exists() and not any((tmp_path / "escape").iterdir())  # nothing was written
    assert isinstance(await trainer.ask("save", SaveCheckpoint(path="after")), Saved)  # still serving


async def test_inside_the_root_save_and_load_work_and_links_out_are_refused(
    trainer: Trainer, tmp_path: Path
) -> None:
    saved = await trainer.ask("save", SaveCheckpoint(path=str(trainer.root / "checkpoint-1"), mode="full"))
    assert isinstance(saved, Saved) and Path(saved.path) == (trainer.root / "checkpoint-1").resolve()
    loaded = await trainer.ask("load", LoadCheckpoint(path="checkpoint-1", weight_version=2))
    assert isinstance(loaded, CheckpointLoaded) and loaded.weight_version == 2
    # a checkpoint inside the root whose DCP metadata links to a file outside: refused before reading
    hostile = trainer.root / "hostile"
    (trainer.root / "checkpoint-1").rename(hostile)
    metadata = hostile / "trainer" / "actor" / ".metadata"
    planted = tmp_path / "planted.metadata"
    metadata.rename(planted)
    metadata.symlink_to(planted)
    message = await trainer.refused("load", LoadCheckpoint(path=str(hostile)))
    assert "links outside the root" in message and ".metadata" in message
    assert trainer.worker.weight_version == 2  # the refused load changed nothing
