"""LocalTensorStore: capacity, TTL, reservations for streamed puts, refusal to overwrite and stat."""

from __future__ import annotations

import pytest
import torch

from rlfleet.common.errors import (
    KeyExists,
    MalformedChunk,
    StoreFull,
    UnknownDtype,
    UnknownKey,
    UnknownTensor,
)
from rlfleet.common.tensors.local import LocalTensorStore, TensorInfo


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _store(capacity: int = 1000, ttl: float = 10.0) -> tuple[LocalTensorStore, Clock]:
    clock = Clock()
    return LocalTensorStore(capacity_bytes=capacity, ttl_s=ttl, clock=clock), clock


def test_put_get_delete_and_accounting() -> None:
    store, _ = _store()
    tensors = {"a": torch.zeros(10), "b": torch.ones(5, dtype=torch.int16)}
    assert store.put("k", tensors) == 50
    assert store.used_bytes == 50
    assert store.keys == ["k"]
    got = store.get("k")
    assert list(got) == ["a", "b"]
    assert got["a"].data_ptr() == tensors["a"].data_ptr()  # shared, not copied
    assert list(store.get("k", ["b", "a", "b"])) == ["b", "a"]
    with pytest.raises(UnknownTensor, match="no tensor named 'zz'"):
        store.get("k", ["zz"])
    with pytest.raises(UnknownKey):
        store.get("missing")
    assert store.delete("k") is True
    assert store.delete("k") is False
    assert store.used_bytes == 0


def test_put_over_capacity_raises_store_full_and_changes_nothing() -> None:
    store, _ = _store(capacity=100)
    store.put("a", {"x": torch.zeros(20)})  # 80 bytes
    with pytest.raises(StoreFull) as info:
        store.put("b", {"y": torch.zeros(6)})  # 24 more
    assert (info.value.requested, info.value.used, info.value.capacity) == (24, 80, 100)
    assert store.keys == ["a"] and store.used_bytes == 80 and store.reserved_bytes == 0


def test_unknown_dtype_is_refused_by_put() -> None:
    store, _ = _store()
    with pytest.raises(UnknownDtype):
        store.put("k", {"c": torch.zeros(2, dtype=torch.complex64)})
    assert store.keys == []


def test_entries_expire_after_ttl() -> None:
    store, clock = _store(ttl=10.0)
    store.put("old", {"x": torch.zeros(2)})
    clock.now += 6
    store.put("new", {"x": torch.zeros(2)})
    assert store.stat("old").expires_in_s == pytest.approx(4.0)
    clock.now += 5
    assert store.keys == ["new"]
    assert store.used_bytes == 8
    with pytest.raises(UnknownKey):
        store.get("old")
    clock.now += 10
    assert store.purge_expired() == 1
    assert store.used_bytes == 0


def test_reservation_commits_or_releases() -> None:
    store, _ = _store(capacity=100)
    kept = store.reserve()
    kept.add(40)
    dropped = store.reserve()
    dropped.add(40)
    assert store.reserved_bytes == 80
    with pytest.raises(StoreFull) as info:
        store.reserve().add(30)
    assert info.value.used == 80
    dropped.release()
    dropped.release()  # idempotent
    assert store.reserved_bytes == 40
    assert kept.commit("k", {"x": torch.zeros(10)}) == 40
    assert store.reserved_bytes == 0 and store.used_bytes == 40
    kept.release()  # after commit: a no-op
    assert store.used_bytes == 40


def test_commit_checks_key_and_size() -> None:
    store, _ = _store()
    reservation = store.reserve()
    reservation.add(8)
    with pytest.raises(MalformedChunk, match="non-empty key"):
        reservation.commit("", {"x": torch.zeros(2)})
    with pytest.raises(RuntimeError, match="reservation of 8"):
        reservation.commit("k", {"x": torch.zeros(3)})
    reservation.release()
    assert store.reserved_bytes == 0


def test_a_put_never_overwrites_a_key() -> None:
    store, _ = _store(capacity=100)
    store.put("k", {"x": torch.zeros(10)})
    with pytest.raises(KeyExists, match="never overwrites"):
        store.put("k", {"y": torch.zeros(5)})
    assert store.used_bytes == 40 and store.reserved_bytes == 0
    assert list(store.get("k")) == ["x"]
    store.delete("k")
    store.put("k", {"y": torch.zeros(5)})  # once deleted, the key may be used again
    assert list(store.get("k")) == ["y"]


def test_stat_lists_tensors() -> None:
    store, _ = _store()
    store.put("k", {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "s": torch.tensor(1)})
    stat = store.stat("k")
    assert stat.tensors == (TensorInfo("w", "BF16", (2, 3), 12), TensorInfo("s", "I64", (), 8))
    assert (stat.used_bytes, stat.capacity_bytes, stat.key_count) == (20, 1000, 1)
    assert store.stat().tensors == () and store.stat().expires_in_s is None
    with pytest.raises(UnknownKey):
        store.stat("missing")


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        LocalTensorStore(capacity_bytes=10, ttl_s=0)
