"""ClientPool: one TensorStore client per store address, kept open, the least recently used closed
past its cap; real stores on port 0."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch

from rlfleet.common.errors import TransportClosed
from rlfleet.common.schema.worker import TensorPlaneSettings
from rlfleet.common.tensors.client import ClientPool, TensorStoreClient
from rlfleet.common.tensors.server import TensorStoreServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def stores() -> AsyncIterator[list[TensorStoreServer]]:
    servers = [TensorStoreServer(capacity_bytes=1 << 20) for _ in range(3)]
    for server in servers:
        await server.start()
    yield servers
    for server in servers:
        await server.stop()


async def test_one_client_per_address_fetches_from_every_store(stores: list[TensorStoreServer]) -> None:
    pool = ClientPool(TensorPlaneSettings())
    refs = [s.put_local(f"k{i}", {"x": torch.full((4,), float(i))}) for i, s in enumerate(stores)]
    for _ in range(2):
        for i, ref in enumerate(refs):
            got = await pool.fetch(ref)
            assert torch.equal(got["x"], torch.full((4,), float(i)))
    assert len(pool) == 3
    assert pool.get(stores[0].address) is pool.get(stores[0].address)
    client = pool.get(stores[1].address)
    await pool.close()
    assert len(pool) == 0
    with pytest.raises(TransportClosed):
        await client.fetch(refs[1])
    assert torch.equal((await pool.fetch(refs[1]))["x"], torch.full((4,), 1.0))  # usable again
    await pool.close()
    await pool.close()  # twice is fine


async def test_past_its_cap_the_least_recently_used_client_is_closed(stores: list[TensorStoreServer]) -> None:
    made: list[TensorStoreClient] = []

    def connect(address: str) -> TensorStoreClient:
        made.append(TensorStoreClient(address))
        return made[-1]

    pool = ClientPool(max_clients=2, connect=connect)
    first, second, third = (s.address for s in stores)
    pool.get(first)
    pool.get(second)
    pool.get(first)  # now the second is the least recently used
    pool.get(third)
    assert first in pool and third in pool and second not in pool
    assert [c.address for c in made] == [first, second, third]
    await pool.close()  # also waits for the second's close
    for client in made:
        with pytest.raises(TransportClosed):
            await client.stat()


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_clients"):
        ClientPool(max_clients=0)


async def test_fetch_all_keeps_the_order_and_raises_the_first_failure_as_it_came(
    stores: list[TensorStoreServer],
) -> None:
    """Several refs pulled at once (fewer streams than refs) come back in the refs' order; a ref gone
    from its store fails the call with the store's own error, and the pool serves the next call."""
    from rlfleet.common.errors import UnknownKey

    pool = ClientPool(TensorPlaneSettings())
    refs = [stores[i % 3].put_local(f"b{i}", {"x": torch.full((4,), float(i))}) for i in range(9)]
    got = await pool.fetch_all(refs, at_once=2)
    assert [float(b["x"][0]) for b in got] == [float(i) for i in range(9)]
    stores[1].delete(refs[4].key)
    with pytest.raises(UnknownKey, match=refs[4].key):
        await pool.fetch_all(refs, at_once=2)
    assert len(await pool.fetch_all(refs[:4])) == 4
    with pytest.raises(ValueError, match="at_once must be at least 1"):
        await pool.fetch_all(refs, at_once=0)
    await pool.close()


async def test_fetch_into_hands_each_ref_over_as_it_comes_and_stops_on_a_failure(
    stores: list[TensorStoreServer],
) -> None:
    """``fetch_into`` runs its consumer on a thread over the refs' tensors as they come: every ref
    once; a ref gone from its store reaches the consumer as the store's own error (after the refs
    that came); a consumer that stops early ends the call with its own error."""
    from rlfleet.common.errors import UnknownKey

    pool = ClientPool(TensorPlaneSettings())
    refs = [stores[i % 3].put_local(f"b{i}", {"x": torch.full((4,), float(i))}) for i in range(9)]
    got = await pool.fetch_into(refs, lambda buckets: sorted(float(b["x"][0]) for b in buckets), at_once=2)
    assert got == [float(i) for i in range(9)]
    stores[1].delete(refs[4].key)
    seen: list[float] = []

    def keep(buckets: object) -> None:
        for bucket in buckets:  # type: ignore[attr-defined]
            seen.append(float(bucket["x"][0]))

    with pytest.raises(UnknownKey, match=refs[4].key):
        await pool.fetch_into(refs, keep, at_once=1)
    assert 4.0 not in seen and len(seen) < 9

    def first_only(buckets: object) -> None:
        next(iter(buckets))  # type: ignore[call-overload]
        raise RuntimeError("the consumer refused the bucket")

    with pytest.raises(RuntimeError, match="refused the bucket"):
        await pool.fetch_into(refs[:4], first_only)
    assert len(await pool.fetch_all(refs[:4])) == 4  # the pool serves the next call
    await pool.close()
