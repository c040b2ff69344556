"""A weight load is all or nothing (issue 29, point 4): a load that fails partway never leaves an
engine serving a mix of two versions under the version it reports.

The worker tests run a real rollout worker (HF engine, tiny model, CPU) on a real nats-server and
pull the buckets of a second model from a real TensorStore over gRPC, as they come from a
trainer (the fixtures ``worker``, ``store`` and ``control`` of conftest.py). The vLLM tests run
the CPU build where it is installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM
from weight_buckets import weight_buckets  # (this folder's helper module)

from rlfleet.common.control.messages import LoadWeights, SamplingParams, WeightsLoaded
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.errors import BatchContractError, RemoteError, RemoteUserError
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors.server import TensorStoreServer
from rlfleet.rollout.engines import HFEngine
from rlfleet.rollout.engines.weights import TiedPair, copy_weights, load_targets, write_delta_in_place
from rlfleet.rollout.errors import IncompleteWeights, WeightsTorn
from rlfleet.rollout.service import RolloutWorker

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
PROMPTS = [[30, 11, 8, 15], [5, 40, 6], [50, 60, 44, 9, 13, 21]]


def _state(path: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def _assert_holds(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``model`` equals ``state``'s: one version, not a mix."""
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), f"{name} changed: the engine holds a mix of versions"


def _publish(store: TensorStoreServer, path: Path, version: int) -> list[TensorRef]:
    """``path``'s weights staged as a trainer stages them: small buckets in the store (several per block)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    buckets = list(weight_buckets(model, 8_000))
    assert len(buckets) >= 4
    return [store.put_local(f"weights/v{version}/{i}", b) for i, b in enumerate(buckets)]


@pytest.mark.timeout(90)
async def test_a_bucket_that_cannot_be_fetched_leaves_the_old_version_whole(
    worker: RolloutWorker, store: TensorStoreServer, control: NatsTransport, make_checkpoint
) -> None:
    old, new = _state(make_checkpoint(seed=0)), _state(make_checkpoint(seed=1))
    refs = _publish(store, make_checkpoint(seed=1), version=1)
    store.delete(refs[-1].key)  # the last bucket is gone by the time the worker fetches it
    load = LoadWeights(weight_version=1, buckets=refs, job_id="load-1")
    with pytest.raises(RemoteError, match="weights/v1/"):
        await control.request(worker.own_subject, load, timeout=30, tier="rollout")
    assert worker.weight_version == 0 and worker.engine.weight_version == 0
    _assert_holds(worker.engine.model, old)

    refs = _publish(store, make_checkpoint(seed=1), version=1)  # staged again: the load goes through
    again = load.model_copy(update={"buckets": refs, "job_id": "load-2"})
    reply = await control.request(worker.own_subject, again, timeout=30, tier="rollout")
    assert isinstance(reply, WeightsLoaded) and reply.weight_version == 1
    _assert_holds(worker.engine.model, new)


@pytest.mark.timeout(90)
async def test_a_bad_last_bucket_is_refused_before_any_bucket_is_loaded(
    worker: RolloutWorker, store: TensorStoreServer, control: NatsTransport, make_checkpoint
) -> None:
    old = _state(make_checkpoint(seed=0))
    before = worker.engine.generate(PROMPTS, GREEDY)
    refs = _publish(store, make_checkpoint(seed=1), version=1)
    bad = store.put_local("weights/v1/bad", {"model.norm.weight": torch.ones(7)})  # hidden size is 32
    load = LoadWeights(weight_version=1, buckets=[*refs, bad], job_id="load-bad")
    with pytest.raises(RemoteUserError, match=r"model.norm.weight.*shape \[7\]"):
        await control.request(worker.own_subject, load, timeout=30, tier="rollout")
    assert worker.weight_version == 0 and worker.engine.weight_version == 0
    _assert_holds(worker.engine.model, old)
    after = worker.engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]


@pytest.mark.timeout(30)
def test_a_copy_that_fails_partway_puts_back_what_it_overwrote() -> None:
    module = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 2)})
    targets = load_targets(module)
    old = {name: t.detach().clone() for name, t in targets.items()}
    bucket = {
        "a.weight": torch.randn(4, 4),
        "a.bias": torch.randn(4),
        "b.weight": torch.empty(2, 4, device="meta"),  # passes the checks; its copy fails
    }
    with pytest.raises(NotImplementedError, match="meta"):
        copy_weights(targets, bucket)
    for name, tensor in targets.items():
        assert torch.equal(tensor, old[name]), f"{name} kept the failed load's value"


@pytest.mark.timeout(30)
def test_a_delta_that_fails_partway_in_the_engine_puts_back_what_it_overwrote() -> None:
    """A delta goes straight into the live weights (the HF engine's ``load_delta``), bucket by
    bucket as they come: a write, a later bucket's check or the pull of a later bucket that fails
    puts back everything written before it; tied names without shared storage follow."""
    module = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 2)})
    targets = load_targets(module)
    old = {name: t.detach().clone() for name, t in targets.items()}

    def unchanged() -> None:
        for name, tensor in targets.items():
            assert torch.equal(tensor, old[name]), f"{name} kept the failed delta's value"

    first = {"a.weight": torch.randn(4, 4), "a.bias@idx": torch.tensor([1, 3]), "a.bias@val": torch.ones(2)}
    broken_write = {
        "b.weight@idx": torch.tensor([0, 5], dtype=torch.int32),
        "b.weight@val": torch.empty(2, device="meta"),  # passes the checks; its write fails
    }
    with pytest.raises(NotImplementedError, match="meta"):
        write_delta_in_place(targets, [{**first, **broken_write}])
    unchanged()
    out_of_range = {"b.bias@idx": torch.tensor([2]), "b.bias@val": torch.zeros(1)}
    with pytest.raises(BatchContractError, match="an index outside"):  # the second bucket's check
        write_delta_in_place(targets, [first, out_of_range])
    unchanged()

    def pulled_then_lost() -> Iterator[dict[str, torch.Tensor]]:
        yield first
        raise ConnectionError("the store went away")  # as a failed pull reaches the engine

    with pytest.raises(ConnectionError, match="went away"):
        write_delta_in_place(targets, pulled_then_lost())
    unchanged()
    assert write_delta_in_place(targets, [first]) == ["a.weight", "a.bias"]
    assert torch.equal(targets["a.weight"], first["a.weight"]) and targets["a.bias"][1] == 1
    twin = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "c": torch.nn.Linear(4, 4)})  # untied storage
    both = load_targets(twin)
    seen: list[list[str]] = []  # each bucket's weights handed on once written (the worker hashes them)
    changed = write_delta_in_place(both, [{"a.weight@idx": torch.tensor([3]), "a.weight@val": torch.ones(1)},
                                          {"a.bias@idx": torch.tensor([0]), "a.bias@val": torch.ones(1)}],
                                   (TiedPair("a.weight", "c.weight"),),
                                   lambda items: seen.append([name for name, _ in items]))  # fmt: skip
    assert changed == ["a.weight", "a.bias"] and torch.equal(both["c.weight"], both["a.weight"])
    assert both["a.weight"].view(-1)[3] == 1
    assert seen == [["a.weight", "c.weight"], ["a.bias"]]  # the tied copy too


# --- vLLM (CPU build) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_engine(make_vllm_checkpoint: Callable[..., Path]) -> Iterator[Any]:
    pytest.importorskip("vllm", reason="vLLM is not installed (uv sync --extra cpu)")
    from rlfleet.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(make_vllm_checkpoint(seed=0, tie=True), enforce_eager=True, max_model_len=64)
    yield engine
    engine.close()


def _weights(path: Path, leave_out: tuple[str, ...] = ()) -> list[tuple[str, torch.Tensor]]:
    """``path``'s weights as one publish (the tied head left out, as trainers do)."""
    state = AutoModelForCausalLM.from_pretrained(path).state_dict()
    return [(n, t) for n, t in state.items() if n not in ("lm_head.weight", *leave_out)]


@pytest.mark.timeout(240)
def test_vllm_refuses_an_incomplete_publish_before_loading_any_block(
    vllm_engine: Any, make_vllm_checkpoint: Callable[..., Path]
) -> None:
    before = vllm_engine.generate(PROMPTS, GREEDY)
    items = _weights(make_vllm_checkpoint(seed=1), leave_out=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(IncompleteWeights, match="model.layers.1.mlp.up_proj.weight"):
        vllm_engine.load_weights(items, version=1)
    assert vllm_engine.weight_version == 0
    after = vllm_engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in after] == [c.token_ids for c in before], "blocks of the refused load went in"


@pytest.mark.timeout(240)
def test_vllm_refuses_to_generate_after_a_reload_that_failed_partway(
    vllm_engine: Any, make_vllm_checkpoint: Callable[..., Path]
) -> None:
    items = _weights(make_vllm_checkpoint(seed=1))
    # block 1's tensors pass every check but cannot be copied: the reload breaks off after block 0 went in
    broken = [(n, t.to("meta") if n.startswith("model.layers.1.") else t) for n, t in items]
    with pytest.raises(NotImplementedError, match="meta"):
        vllm_engine.load_weights(broken, version=1)
    assert vllm_engine.weight_version == 0
    with pytest.raises(WeightsTorn, match="failed partway"):
        vllm_engine.generate(PROMPTS, GREEDY)

    vllm_engine.load_weights(items, version=1)  # a full load: the engine serves again, version 1 whole
    assert vllm_engine.weight_version == 1
    expected = HFEngine(make_vllm_checkpoint(seed=1)).generate(PROMPTS, GREEDY)
    got = vllm_engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
