"""The controller's own TensorStore: batches the controller itself makes travel from it.

DPO's preference pairs and the responses a rollout fn writes are put here; the reward and
trainer tiers fetch them like any rollout worker's batch. Mixed into
:class:`~rlfleet.controller.runner.FleetRunner`, which supplies ``config`` and the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlfleet.common.tensor_store import TensorStoreClient, TensorStoreServer

STORE_CAPACITY_BYTES = 1 << 30
"""Capacity of the controller's own store; it holds one step's batch at a time."""


class OwnStore:
    """``own_store()`` (started on first use), ``_release`` of consumed batches, ``_stop_store``."""

    config: Any
    _store: TensorStoreServer | None
    _loop: asyncio.AbstractEventLoop | None

    async def own_store(self) -> TensorStoreServer:
        """The controller's own TensorStore, started on first use, for batches the controller itself
        makes (DPO pairs, responses a rollout fn wrote); the tiers fetch from it like any other."""
        if self._store is None:
            store = TensorStoreServer(capacity_bytes=STORE_CAPACITY_BYTES, ttl_s=3600.0)
            # workers of a joined cluster may run on other machines: listen on every interface then
            await store.start(host="127.0.0.1" if self.config.nats_url is None else "0.0.0.0")
            self._store = store
        return self._store

    async def _release(self, results: list[Any]) -> None:
        """Free consumed rollout batches in their workers' stores (or the controller's own)."""
        for result in results:
            if self._store is not None and result.ref.address == self._store.address:
                self._store.delete(result.ref.key)
                continue
            client = TensorStoreClient(result.ref.address)
            try:
                await client.delete(result.ref.key)
            finally:
                await client.close()

    def _stop_store(self) -> None:
        store, self._store = self._store, None
        if store is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.run_until_complete(store.stop())
