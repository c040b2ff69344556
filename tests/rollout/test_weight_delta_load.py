"""A rollout worker's delta loads (issue 32, points 3 and 4): a worker asked to hold its weights
takes the next version as a delta on them and answers the fingerprint of the result, the published
version's bit for bit; a delta on a version it does not hold, or one that does not fit, is refused
and leaves the engine on the version it reports. Both ways a worker takes a delta: the HF engine
straight into its weights (a ``DeltaEngine``; no host copy), and an engine that loads whole
versions only (as vLLM) through the worker's host copy: the HF engine behind a wrapper that takes
whole loads only.

A real rollout worker (HF engine, tiny model, CPU) on a real nats-server pulls from a real
TensorStore over gRPC, as from a trainer (the fixtures ``worker``, ``store``, ``control`` of
conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from weight_buckets import weight_buckets  # (this folder's helper module)

from rlfleet.common.control.messages import LoadWeights, WeightsLoaded
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.errors import RemoteError
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors.server import TensorStoreServer
from rlfleet.common.tensors.weight_sync import INDEX, fingerprint, weight_delta
from rlfleet.rollout.engines.base import DeltaEngine
from rlfleet.rollout.service import RolloutWorker

pytestmark = pytest.mark.timeout(90)


class WholeLoadsOnly:
    """An engine that takes whole versions only (no ``load_delta``, as vLLM): the HF engine inside."""

    def __init__(self, engine: object) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> object:
        if name == "load_delta":
            raise AttributeError(name)
        return getattr(self._engine, name)


@pytest.fixture(params=["in_engine", "host_copy"])
def way(request: pytest.FixtureRequest, worker: RolloutWorker) -> str:
    """How ``worker`` takes a delta: into the HF engine's weights, or through its host copy."""
    if request.param == "host_copy":
        worker.engine = WholeLoadsOnly(worker.engine)  # type: ignore[assignment]
    return request.param


def _buckets(path: Path) -> list[dict[str, torch.Tensor]]:
    return list(weight_buckets(AutoModelForCausalLM.from_pretrained(path), 8_000))


def _nudged(buckets: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The next version: 1% of every float tensor's elements moved (a delta of indices and values)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for bucket in buckets:
        new = {n: t.clone() for n, t in bucket.items()}
        for t in new.values():
            if t.is_floating_point() and t.numel() >= 100:
                picked = torch.randperm(t.numel(), generator=g)[: t.numel() // 100]
                t.view(-1)[picked] += 0.5
        out.append(new)
    return out


def _holds(model: torch.nn.Module, buckets: list[dict[str, torch.Tensor]]) -> None:
    state = model.state_dict()
    for bucket in buckets:
        for name, tensor in bucket.items():
            assert torch.equal(state[name], tensor), f"{name}: the engine does not hold this version"


def _stage(store: TensorStoreServer, buckets: list[dict[str, torch.Tensor]], name: str) -> list[TensorRef]:
    return [store.put_local(f"weights/{name}/{i}", b) for i, b in enumerate(buckets) if b]


async def _load(control: NatsTransport, worker: RolloutWorker, message: LoadWeights) -> WeightsLoaded:
    reply = await control.request(worker.own_subject, message, timeout=30, tier="rollout")
    assert isinstance(reply, WeightsLoaded), reply
    return reply


async def test_a_delta_on_the_version_held_loads_the_new_version_bit_for_bit(
    worker: RolloutWorker, store: TensorStoreServer, control: NatsTransport, make_checkpoint, way: str
) -> None:
    v1 = _buckets(make_checkpoint(seed=0))
    v2 = _nudged(v1)
    first = await _load(control, worker, LoadWeights(weight_version=1, buckets=_stage(store, v1, "v1"),
                                                     hold=True, job_id="l1"))  # fmt: skip
    assert first.fingerprint == fingerprint(item for b in v1 for item in b.items()) and not first.delta
    assert isinstance(worker.engine, DeltaEngine) == (way == "in_engine")
    assert (worker._held is None) == (way == "in_engine")  # the HF engine's own weights are the base
    old = {n: t for b in v1 for n, t in b.items()}
    deltas = _stage(store, [weight_delta(old, b) for b in v2], "v2-delta")
    second = await _load(control, worker, LoadWeights(weight_version=2, buckets=[], delta_buckets=deltas,
                                                      delta_from=1, hold=True, job_id="l2"))  # fmt: skip
    assert second.delta and second.fingerprint == fingerprint(item for b in v2 for item in b.items())
    assert worker.weight_version == 2
    _holds(worker.engine.model, v2)
    v3 = _nudged(v2)  # and the next: a delta on the version the delta made
    new = {n: t for b in v2 for n, t in b.items()}
    deltas = _stage(store, [weight_delta(new, b) for b in v3], "v3-delta")
    third = await _load(control, worker, LoadWeights(weight_version=3, buckets=[], delta_buckets=deltas,
                                                     delta_from=2, hold=True, job_id="l3"))  # fmt: skip
    assert third.delta and third.fingerprint == fingerprint(item for b in v3 for item in b.items())
    _holds(worker.engine.model, v3)


async def test_a_delta_it_cannot_apply_is_refused_and_the_engine_keeps_its_version(
    worker: RolloutWorker, store: TensorStoreServer, control: NatsTransport, make_checkpoint, way: str
) -> None:
    v1 = _buckets(make_checkpoint(seed=0))
    v2 = _nudged(v1)
    old = {n: t for b in v1 for n, t in b.items()}
    deltas = _stage(store, [weight_delta(old, b) for b in v2], "v2-delta")
    # held nothing yet: loaded whole without hold
    await _load(control, worker, LoadWeights(weight_version=1, buckets=_stage(store, v1, "v1"), job_id="l1"))
    delta = LoadWeights(weight_version=2, buckets=[], delta_buckets=deltas, delta_from=1, job_id="d1")
    with pytest.raises(
        RemoteError, match="holds no copy of its weights; the delta applies to version 1"
    ) as no:
        await _load(control, worker, delta)
    assert no.value.code == "delta_base"
    # held version 1, but the delta is on version 0
    await _load(control, worker, LoadWeights(weight_version=1, buckets=_stage(store, v1, "v1b"), hold=True,
                                             job_id="l2"))  # fmt: skip
    with pytest.raises(RemoteError, match="holds a copy of version 1; the delta applies to version 0"):
        await _load(control, worker, delta.model_copy(update={"delta_from": 0, "job_id": "d2"}))
    # a delta that does not fit the copy (an index out of range): refused, nothing changed
    broken = [weight_delta(old, b) for b in v2]
    name = next(k for b in broken for k in b if k.endswith(INDEX))
    for b in broken:
        if name in b:
            b[name] = b[name] + 10**6
    with pytest.raises(RemoteError, match="an index outside"):
        await _load(control, worker, delta.model_copy(update={"delta_buckets": _stage(store, broken, "bad"),
                                                              "job_id": "d3"}))  # fmt: skip
    assert worker.weight_version == 1
    _holds(worker.engine.model, v1)
    # the delta was checked whole before anything was written: version 1 (the copy, or the engine's
    # own weights) is intact
    good = await _load(control, worker, delta.model_copy(update={"job_id": "d4"}))
    assert good.delta and good.fingerprint == fingerprint(item for b in v2 for item in b.items())
    _holds(worker.engine.model, v2)
    # a whole load without hold drops what was held before it: a delta on the new version is
    # refused, never written into the copy of the older one
    await _load(control, worker, LoadWeights(weight_version=1, buckets=_stage(store, v1, "v1c"), hold=True,
                                             job_id="l3"))  # fmt: skip
    await _load(control, worker, LoadWeights(weight_version=2, buckets=_stage(store, v2, "v2c"), job_id="l4"))
    new = {n: t for b in v2 for n, t in b.items()}
    on_v2 = _stage(store, [weight_delta(new, b) for b in _nudged(v2)], "v3-delta")
    with pytest.raises(RemoteError, match="holds no copy of its weights; the delta applies to version 2"):
        await _load(control, worker, LoadWeights(weight_version=3, buckets=[], delta_buckets=on_v2,
                                                 delta_from=2, job_id="d5"))  # fmt: skip
    _holds(worker.engine.model, v2)


async def test_a_bucket_missing_among_many_fails_the_load_by_name_and_keeps_the_version(
    worker: RolloutWorker, store: TensorStoreServer, control: NatsTransport, make_checkpoint
) -> None:
    """The worker pulls a version's buckets several at a time: one that is gone from the store fails
    the load with the store's own error (the others are cancelled), and the engine keeps its version;
    the same load with every bucket there then succeeds."""
    v1 = _buckets(make_checkpoint(seed=0))
    v2 = _nudged(v1)
    await _load(control, worker, LoadWeights(weight_version=1, buckets=_stage(store, v1, "v1"), job_id="l1"))
    refs = _stage(store, v2, "v2")
    assert len(refs) > 4, "enough buckets to be pulled several at a time"
    store.delete(refs[len(refs) // 2].key)
    with pytest.raises(
        RemoteError, match=f"UnknownKey: no tensors stored under key '{refs[len(refs) // 2].key}"
    ):
        await _load(control, worker, LoadWeights(weight_version=2, buckets=refs, job_id="l2"))
    assert worker.weight_version == 1
    _holds(worker.engine.model, v1)
    again = await _load(control, worker, LoadWeights(weight_version=2, buckets=_stage(store, v2, "v2b"),
                                                     job_id="l3"))  # fmt: skip
    assert again.fingerprint == fingerprint(item for b in v2 for item in b.items())
    _holds(worker.engine.model, v2)
