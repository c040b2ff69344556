"""The bookkeeping of lost rollout chunks (controller/lost_chunks.py): which error loses which chunk,
and that a step's chunks stay one per slice of prompts when a lost one is generated again.

The fleet here is a stand-in that records calls (the real tiers are in tests/faults/test_lost_batch.py);
what is tested is StepChunks' own logic: which chunks it replaces, in which place, what it scores
and trains again, and when it gives up.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from rlfleet.common.control.messages import GenerateResult, SamplingParams, ScoreResult, TrainStepResult
from rlfleet.common.errors import remote_error
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.trainer import StepSettings
from rlfleet.controller.errors import ChunkNotRegenerated, NoWorkerServed, RetriesExhausted
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.lost_chunks import MAX_ORDERS, ChunkOrder, ChunkOrders, StepChunks, names_chunk

SAMPLING = SamplingParams(n=2, seed=7, max_tokens=4)
pytestmark = pytest.mark.timeout(30)


def _result(worker: str, job: str, prompts: int, port: int) -> GenerateResult:
    ref = TensorRef(address=f"127.0.0.1:{port}", key=f"rollout/{worker}/{job}")
    return GenerateResult(job_id=job, worker_id=worker, weight_version=3, ref=ref, num_prompts=prompts,
                          num_samples=2 * prompts, num_tokens=8, seconds=0.1)  # fmt: skip


def _unreachable(port: int) -> RetriesExhausted:
    text = f"TensorStoreUnavailable: TensorStore at 127.0.0.1:{port} is unreachable: connection refused"
    cause = remote_error("trainer", "unavailable", text, retryable=True)
    return RetriesExhausted("train step 2", 3, cause)


def test_a_fetch_error_names_the_chunk_of_its_store_only() -> None:
    ref = _result("rollout-1", "j1", 2, 5000).ref
    assert names_chunk(_unreachable(5000), ref)
    assert not names_chunk(_unreachable(50001), ref), "port 50001 is not port 5000"
    refused = remote_error("trainer", "bad_request", "BatchContractError: TensorStore at 127.0.0.1:5000")
    assert not names_chunk(refused, ref), "a user error is not a lost chunk"
    unknown_key = remote_error("reward", "internal", f"UnknownKey: no key {ref.key!r} in the store")
    assert names_chunk(unknown_key, ref), "a producer back on the same port no longer holds the key"
    assert not names_chunk(ValueError("TensorStore at 127.0.0.1:5000"), ref)


def test_chunk_orders_are_bounded_and_forgotten() -> None:
    orders = ChunkOrders()
    results = [_result("rollout-0", f"j{i}", 1, 6000) for i in range(MAX_ORDERS + 5)]
    for r in results:
        orders.record(r, ChunkOrder([[1]], SAMPLING, 3, None, "rollout-0", "inc"))
    assert len(orders) == MAX_ORDERS and orders.get(results[0]) is None
    orders.forget(results[-2:])
    assert orders.get(results[-1]) is None and orders.get(results[-3]) is not None


@dataclass
class Info:
    incarnation: str
    worker_id: str = ""

    @property
    def announce(self) -> Any:
        return self


@dataclass
class StandInFleet:
    """Records score/train/regenerate calls; ``train_errors`` fail the first train requests."""

    alive: dict[str, str]  # worker id -> incarnation
    train_errors: list[BaseException] = field(default_factory=list)
    regenerate_error: BaseException | None = None
    faults: FaultSettings = field(
        default_factory=lambda: FaultSettings(retry_attempts=2, retry_backoff_s=0.01)
    )
    orders: ChunkOrders = field(default_factory=ChunkOrders)
    scored: list[str] = field(default_factory=list)
    trained: list[list[str]] = field(default_factory=list)
    made: list[ChunkOrder] = field(default_factory=list)

    @property
    def registry(self) -> Any:
        return self

    @property
    def gone(self) -> Any:
        return self

    def get(self, tier: str, worker_id: str) -> Info | None:
        return Info(self.alive[worker_id]) if worker_id in self.alive else None

    def rollout_workers(self, pool: str | None, weight_version: int) -> list[Info]:
        return [Info(incarnation, worker_id) for worker_id, incarnation in self.alive.items()]

    def is_gone(self, worker_id: str) -> bool:
        return worker_id not in self.alive

    def generated(self, worker: str, job: str, prompts: list[list[int]], port: int) -> GenerateResult:
        result = _result(worker, job, len(prompts), port)
        self.orders.record(result, ChunkOrder(prompts, SAMPLING, 3, None, worker, self.alive[worker]))
        return result

    async def score(self, results: list[GenerateResult], metadata: Any, endpoint: str) -> list[ScoreResult]:
        [r] = results
        self.scored.append(r.job_id)
        return [
            ScoreResult(job_id=r.job_id, endpoint=endpoint, spec_version="v", scores=[0.5] * r.num_samples)
        ]

    async def train_step(self, step: int, refs: list[TensorRef], scores: list[float], settings: Any) -> Any:
        self.trained.append([ref.key for ref in refs])
        if self.train_errors:
            raise self.train_errors.pop(0)
        assert len(scores) == 2 * 4, "8 samples: 4 prompts, 2 each"
        return TrainStepResult(step=step, metrics={}, weight_version=3)

    async def regenerate(self, order: ChunkOrder) -> GenerateResult:
        """As the fleet does: on a live worker other than the process that lost the chunk, waited for
        while there is none (Fleet.pool_back)."""
        self.made.append(order)
        if self.regenerate_error is not None:
            raise self.regenerate_error
        lost_it = (order.worker_id, order.incarnation)
        while not (others := [w for w, inc in self.alive.items() if (w, inc) != lost_it]):
            await asyncio.sleep(0.05)
        return self.generated(others[0], f"again-{len(self.made)}", order.prompts, 6000)


def _two_chunks(fleet: StandInFleet) -> StepChunks:
    results = [
        fleet.generated("rollout-0", "a", [[1], [2]], 6000),
        fleet.generated("rollout-1", "b", [[3], [4]], 7000),
    ]
    return StepChunks(fleet, results, [[{}, {}], [{}, {}]], "default")


def test_a_chunk_the_trainer_cannot_fetch_is_generated_again_in_its_place() -> None:
    fleet = StandInFleet({"rollout-0": "i0", "rollout-1": "i1"}, train_errors=[_unreachable(7000)])
    chunks = _two_chunks(fleet)
    stepped = asyncio.run(chunks.train(2, StepSettings()))
    assert stepped.step == 2
    assert [o.prompts for o in fleet.made] == [[[3], [4]]], "the lost chunk's prompts, once"
    assert fleet.made[0].sampling.seed == 7 and fleet.made[0].weight_version == 3
    assert fleet.scored == ["a", "b", "again-1"], "the new chunk is scored; the kept one is not again"
    assert fleet.trained == [["rollout/rollout-0/a", "rollout/rollout-1/b"],
                             ["rollout/rollout-0/a", "rollout/rollout-0/again-1"]]  # fmt: skip
    assert [r.job_id for r in chunks.results] == ["a", "again-1"] and chunks.regenerated == 1


def test_a_chunk_whose_producer_is_gone_is_made_again_before_it_is_scored() -> None:
    fleet = StandInFleet({"rollout-0": "i0", "rollout-1": "i1"})
    chunks = _two_chunks(fleet)
    fleet.alive["rollout-1"] = "restarted"  # back under its id as a new process: its store is new
    asyncio.run(chunks.train(2, StepSettings()))
    assert fleet.scored == ["a", "again-1"] and len(fleet.trained) == 1


def test_no_live_worker_to_make_it_again_is_a_named_error() -> None:
    fleet = StandInFleet({"rollout-0": "i0", "rollout-1": "i1"}, train_errors=[_unreachable(7000)])
    fleet.regenerate_error = NoWorkerServed("rollout pool 'a' had no live worker for 300 s")
    chunks = _two_chunks(fleet)
    with pytest.raises(ChunkNotRegenerated) as caught:
        asyncio.run(chunks.train(2, StepSettings()))
    assert caught.value.job_id == "b" and caught.value.worker_id == "rollout-1"
    assert len(fleet.made) == 1, "the fleet waited for the pool within its budget: its answer is final"
    assert "rollout chunk b (2 prompts) was lost with rollout worker rollout-1" in str(caught.value)


def test_an_error_about_no_chunk_is_raised_as_it_is() -> None:
    refused = remote_error("trainer", "bad_request", "BatchContractError: scores do not match")
    fleet = StandInFleet({"rollout-0": "i0", "rollout-1": "i1"}, train_errors=[refused])
    with pytest.raises(type(refused)):
        asyncio.run(_two_chunks(fleet).train(2, StepSettings()))
    assert fleet.made == []


def test_a_lone_worker_restarted_under_its_id_makes_its_chunk_again_once_it_is_back() -> None:
    fleet = StandInFleet({"rollout-0": "i0"})
    only = fleet.generated("rollout-0", "a", [[1], [2], [3], [4]], 6000)
    chunks = StepChunks(fleet, [only], [[{}] * 4], "")
    del fleet.alive["rollout-0"]  # crashed: no worker until the launcher's restart announces

    async def run() -> TrainStepResult:
        async def back() -> None:
            await asyncio.sleep(0.5)
            fleet.alive["rollout-0"] = "i0-restarted"

        task = asyncio.create_task(back())
        stepped = await chunks.train(2, StepSettings())
        await task
        return stepped

    assert asyncio.run(run()).step == 2
    assert fleet.scored == ["again-1"] and chunks.results[0].worker_id == "rollout-0"
    assert fleet.orders.get(chunks.results[0]).incarnation == "i0-restarted"
