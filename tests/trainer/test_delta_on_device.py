"""Delta sync on a trainer's GPU (issue 32, point 4): each version's buckets are kept on the device
and the next publish compares there (``sync_parts(..., on_device=)``), giving the delta the host's
comparison gives, bucket for bucket and bit for bit. Here the kept buckets are on the CPU (the
trainer keeps them only on CUDA, where ``weight_delta`` compares them on their own device: that
torch path is checked against the host's in ``tests/common/test_weight_sync.py``; the GPU run is
``benchmarks/weight_sync.py --device cuda``), so this checks which buckets are compared."""

from __future__ import annotations

import torch

from rlfleet.common.tensors.store import TensorStoreServer
from rlfleet.common.tensors.weight_sync import apply_delta, delta_parts, fingerprint
from rlfleet.trainer.service import sync_parts


def _buckets(seed: int, moved: float) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    first = {"a.weight": torch.randn(48, 32, generator=g), "a.bias": torch.randn(32, generator=g)}
    second = {"b.weight": torch.randn(40, 16, generator=g), "c.norm": torch.randn(16, generator=g)}
    buckets = [{k: v.to(torch.bfloat16) for k, v in b.items()} for b in (first, second)]
    if moved:
        pick = torch.Generator().manual_seed(seed)
        for bucket in buckets:
            for name, t in bucket.items():
                flat = t.view(-1)
                hit = torch.rand(flat.numel(), generator=pick) < (1.0 if name == "c.norm" else moved)
                flat[hit] = (flat[hit].float() + 0.25).to(torch.bfloat16)
    return buckets


def _store(store: TensorStoreServer, version: int, buckets: list[dict[str, torch.Tensor]]) -> list:
    return [store.put_local(f"weights/v{version}/{i}", {k: v.clone() for k, v in b.items()})
            for i, b in enumerate(buckets)]  # fmt: skip


def _deltas(store: TensorStoreServer, refs: list) -> list[dict[str, torch.Tensor]]:
    return [store.get_local(ref.key) for ref in refs]


def test_versions_kept_on_the_device_give_the_hosts_delta() -> None:
    store = TensorStoreServer(capacity_bytes=1 << 24, ttl_s=600)
    before, after = _buckets(0, 0.0), _buckets(1, 0.05)
    old, new = _store(store, 1, before), _store(store, 2, after)
    printed, by_host = sync_parts(store, 2, new, old)
    again = _store(store, 3, after)  # the same version again, compared on the device this time
    kept = ([{k: v.clone() for k, v in b.items()} for b in before], [{k: v.clone() for k, v in b.items()}
            for b in after])  # fmt: skip
    printed_too, on_device = sync_parts(store, 3, again, old, torch.device("cpu"), kept)
    assert printed == printed_too
    assert len(by_host) == len(on_device) == 2
    hosts = _deltas(store, by_host)
    assert "a.weight" in delta_parts(hosts[0]).sparse and "c.norm" in delta_parts(hosts[1]).whole
    for host, dev in zip(hosts, _deltas(store, on_device), strict=True):
        assert host.keys() == dev.keys()
        for key in host:
            assert host[key].dtype == dev[key].dtype and torch.equal(host[key], dev[key]), key
    held = {k: v.clone() for b in before for k, v in b.items()}
    for delta in _deltas(store, on_device):
        apply_delta(held, delta)
    assert fingerprint(held.items()) == printed  # the receiver ends on the published version, bit for bit


def test_kept_buckets_that_do_not_match_the_version_fall_back_to_the_host() -> None:
    store = TensorStoreServer(capacity_bytes=1 << 24, ttl_s=600)
    before, after = _buckets(0, 0.0), _buckets(2, 0.05)
    old, new = _store(store, 1, before), _store(store, 2, after)
    _, by_host = sync_parts(store, 2, new, old)
    again = _store(store, 3, after)
    short = (before, after[:1])  # one bucket short of the version
    _, fallback = sync_parts(store, 3, again, old, torch.device("cpu"), short)
    for host, other in zip(_deltas(store, by_host), _deltas(store, fallback), strict=True):
        assert host.keys() == other.keys()
        assert all(torch.equal(host[k], other[k]) for k in host)
