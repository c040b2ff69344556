"""The controller's own TensorStore (:class:`OwnStore`), and its clients of the other tiers' stores.

What the controller itself holds on the tensor plane (DPO's preference pairs, responses a rollout
fn wrote, the answers an evaluation scores) and how it reads a few texts from the other tiers'
stores. A training run holds one (:class:`~rlfleet.controller.run.FleetRun`), and so does
``rlfleet eval``'s reward tier (:class:`~rlfleet.controller.eval_scoring.EvalRewardTier`), which
runs without a run.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlfleet.common.control.messages import GenerateResult
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.worker import TensorPlaneSettings
from rlfleet.common.tensors.store import ClientPool, TensorStoreServer, worker_store

STORE_CAPACITY_BYTES = 1 << 30
"""Capacity of the controller's own store; it holds one step's batch at a time."""


class OwnStore:
    """The controller's own TensorStore, and its clients of the other tiers' stores.

    DPO's preference pairs and the responses a rollout fn writes are put here; the reward and
    trainer tiers fetch them like any rollout worker's batch. The store starts on first use, on
    the run's tensor plane settings (``bind_host``, ``advertise_host``, TLS), as every worker's
    does; the clients (one per store, kept for the run) speak TLS when the run trusts a CA.
    Consumed batches are released here; a rollout worker releases its own (only a store's owner
    may delete).
    """

    def __init__(self, settings: TensorPlaneSettings, *, listen_all: bool) -> None:
        plane = settings.model_dump(include=set(TensorPlaneSettings.model_fields))
        if listen_all and "bind_host" not in settings.model_fields_set:
            plane["bind_host"] = "0.0.0.0"  # workers of a joined cluster may run on other machines
        self.settings = TensorPlaneSettings.model_validate(plane)
        self.server: TensorStoreServer | None = None
        self._clients = ClientPool(self.settings)
        self._starting = asyncio.Lock()  # two first users at once start one server, not two

    async def get(self) -> TensorStoreServer:
        """The controller's own TensorStore, started on first use (once, however many ask at once:
        a second server, started beside the first and never stopped, would be collected after its
        event loop closed, with a gRPC "Event loop is closed" traceback)."""
        async with self._starting:
            if self.server is None:
                self.server = await worker_store(
                    self.settings, capacity_bytes=STORE_CAPACITY_BYTES, ttl_s=3600.0
                )
        return self.server

    async def fetch(self, ref: TensorRef, names: list[str] | None = None) -> dict[str, Any]:
        """The tensors a ref names, from whichever tier's store holds them (a few texts, never a batch)."""
        return await self._clients.fetch(ref, names)

    async def release(self, results: list[GenerateResult]) -> None:
        """Free the consumed batches this store holds (the fn-written ones)."""
        for result in results:
            if self.server is not None and result.ref.address == self.server.address:
                self.server.delete(result.ref.key)

    async def stop(self) -> None:
        """Close the clients and stop the store if it was started (idempotent)."""
        await self._clients.close()
        server, self.server = self.server, None
        if server is not None:
            await server.stop()
