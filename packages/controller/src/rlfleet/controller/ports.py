"""The seams of a run: what its parts receive instead of the run (issue 28, "ports, not the run").

:class:`~rlfleet.controller.run.FleetRun` is the composition root: it builds the launcher, the
fleet client, the controller's own store and the helpers, and hands each helper only the ports it
uses, typed here. This module does no work (two small functions read a launcher's workers for
error messages) and imports no helper, so every helper may import it and none imports the run::

    port          implemented by                  received by
    Launcher      EmbeddedFleet, RayFleet         supervision, rollout_scaling, worker_configs
    FleetClient   Fleet (SupervisedFleet)         online, dpo, routing, lost_chunks, samples,
                                                  run_eval, run_reward, rollout_scaling, supervision
    RunState      FleetRun.state                  every helper: config, step, weight version,
                                                  epoch, output_dir, cluster
    Checkpoints   FleetRun                        supervision (a trainer restored)

A step program (:class:`StepProgram`: ``OnlineStep``, ``DPOStep``) writes one step against the
:class:`FleetClient` it is given; a batch is followed from ``OnlineStep.step`` through
:meth:`FleetClient.generate`, :meth:`~FleetClient.score`, :meth:`~FleetClient.train_step` and
:meth:`~FleetClient.publish_weights` to :class:`~rlfleet.controller.fleet.Fleet`, its one real
implementation (tests answer the same calls in memory).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from rlfleet.common.control.membership import WorkerInfo, WorkerRegistry
from rlfleet.common.control.messages import (
    CheckpointLoaded,
    GenerateResult,
    SamplingParams,
    ScoreResult,
    TrainerConfigure,
    TrainerConfigured,
    TrainStepResult,
    WeightsLoaded,
    WeightsPublished,
)
from rlfleet.common.control.messages.rollout import EpisodeSpec
from rlfleet.common.control.transport import Transport
from rlfleet.common.schema.carriers import CarrierSetting
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.trainer import StepSettings
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.errors import TierDied, TierNotReady
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.launcher import WorkerProcess, WorkerSpec

if TYPE_CHECKING:
    from rlfleet.controller.dataset import PromptItem
    from rlfleet.controller.reward_control import RewardControl

# --- the run's state ------------------------------------------------------------------------------


@dataclass
class RunState:
    """Where a run stands: its config and fixed facts, and the counters a checkpoint keeps and a
    restored trainer rewinds. The run owns it; helpers read it, and the few that move the run on (the step
    loop, a publish, a resume) write it."""

    config: TrainerConfig
    output_dir: Path
    cluster: str
    """The run's cluster name (the second token of its NATS subjects)."""
    global_step: int = 0
    """Steps taken (a resumed run counts those of its checkpoint)."""
    weight_version: int = 0
    """The weight version the rollout workers hold (0 before the first publish)."""
    epoch: int = 0
    """The dataset epoch the next batch comes from."""
    publish_dtype: str = ""
    """The dtype weights are published in, fixed by the engines' dtype when the run is made
    (:meth:`~rlfleet.controller.config.TrainerConfig.publish_dtype`; "": the trainer's own)."""


# --- what starts the run's processes --------------------------------------------------------------


class Launcher(Protocol):
    """What starts, watches and stops a run's processes: the run's nats-server and its workers
    (:class:`~rlfleet.controller.launcher.EmbeddedFleet`: local processes;
    :class:`~rlfleet.controller.ray_launcher.RayFleet`: Ray-placed ones)."""

    workers: list[WorkerProcess]
    """The workers it started and supervises, in start order."""
    on_restart: Callable[[WorkerProcess, TierDied], None] | None
    """Told (in :meth:`check`) of each worker started again and its death; what it raises,
    ``check`` raises."""

    @property
    def url(self) -> str:
        """The NATS URL its workers connect to."""
        ...

    @property
    def pids(self) -> list[int]:
        """Every process it started and has not stopped (nats-server first)."""
        ...

    def start_nats(self, cluster: str = "*") -> str:
        """Start the run's own nats-server with fresh per-role credentials; returns its URL."""
        ...

    def connection(self, role: str = "controller") -> NatsConnection:
        """How a client of ``role`` logs in to the run's own nats-server."""
        ...

    def spawn(self, spec: WorkerSpec) -> WorkerProcess:
        """Start one worker (supervised from now on)."""
        ...

    def check(self) -> None:
        """Restart what died within the restart budget; raise :class:`TierDied` for anything else."""
        ...

    def restart_tier(self, tier: str, died: TierDied) -> list[WorkerProcess]:
        """Stop every process of ``tier`` and start them again (a trainer restored by the run)."""
        ...

    def retire(self, workers: Sequence[WorkerProcess]) -> None:
        """Stop supervising ``workers`` (their exit is no crash) and record what still runs; the
        caller stops them."""
        ...

    def stop(self, timeout: float = 10.0) -> None:
        """Stop exactly the processes it started (each worker drains first)."""
        ...


def describe_worker(launcher: Launcher | None, worker_id: str) -> str:
    """A started worker's id, pid, state and log (just its id when the run did not start it)."""
    for worker in launcher.workers if launcher is not None else []:
        if worker.spec.worker_id == worker_id:
            return worker.describe()
    return worker_id


def not_ready(
    launcher: Launcher | None, registry: WorkerRegistry, timeout: float, detail: str
) -> TierNotReady:
    """:class:`TierNotReady` naming the started workers that never announced (or just the tiers,
    when the run joined a fleet it did not start)."""
    missing = [
        worker.describe()
        for worker in (launcher.workers if launcher is not None else [])
        if registry.get(worker.spec.tier, worker.spec.worker_id) is None
    ]
    return TierNotReady(timeout, missing, detail)


# --- the requests a run makes of the tiers --------------------------------------------------------


@dataclass(frozen=True)
class ChunkOrder:
    """What one rollout chunk was asked for, and the process that answered: enough to make it again
    (:mod:`rlfleet.controller.lost_chunks`)."""

    prompts: list[list[int]]
    sampling: SamplingParams
    weight_version: int
    pool: str | None
    worker_id: str
    incarnation: str
    """The answering process (its announce's incarnation): a worker back under the same id is another."""
    episode: EpisodeSpec | None = None
    """A multi-turn chunk's episodes (its prompts' items), as asked for."""


ChunkDone = Callable[[int, GenerateResult], None]
"""Told of one rollout chunk as soon as it is generated, while the step's other chunks still are:
the index of its first prompt in the prompts asked for, and its result (:meth:`FleetClient.generate`)."""


class ChunkOrderBook(Protocol):
    """The orders of the chunks a fleet generated, by their result
    (:class:`~rlfleet.controller.lost_chunks.ChunkOrders`)."""

    def record(self, result: GenerateResult, order: ChunkOrder) -> None: ...
    def get(self, result: GenerateResult) -> ChunkOrder | None: ...
    def forget(self, results: Sequence[GenerateResult]) -> None: ...


class FleetClient(Protocol):
    """The run's handle on the rollout, reward and trainer tiers of one cluster: every call a control
    message, the bulk data handed from tier to tier as refs (:class:`~rlfleet.controller.fleet.Fleet`)."""

    transport: Transport
    """The control-plane connection its requests go on."""
    cluster: str
    registry: WorkerRegistry
    """Which workers are live."""
    faults: FaultSettings
    """The run's retry budget."""
    orders: ChunkOrderBook
    """What each rollout chunk was asked for, so that a chunk lost with its worker is made again."""
    published: WeightsPublished | None
    """The last weight version every rollout worker must hold."""
    reward: RewardControl | None
    """The reward tier, once the run attached it."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...

    async def wait_ready(self, counts: dict[str, int], timeout: float) -> None:
        """Until each tier announced ``counts[tier]`` workers (``TimeoutError`` after ``timeout``)."""
        ...

    def rollout_workers(self, pool: str | None = None, weight_version: int = -1) -> list[WorkerInfo]: ...

    def admit(self, worker: WorkerInfo, published: WeightsPublished) -> Awaitable[None]:
        """Load the published weights into a stale (late) rollout worker, in the background (one load
        per worker and version); await it to wait for that load."""
        ...

    def forget(self, tier: str, worker_id: str) -> None:
        """Forget a worker that is gone: requests in flight to it end now, not at their deadline."""
        ...

    def is_gone(self, worker_id: str) -> bool: ...

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, weight_version: int, *,
        pool: str | None = None, on_chunk: ChunkDone | None = None, episode: EpisodeSpec | None = None,
    ) -> list[GenerateResult]:  # fmt: skip
        """One result per chunk, in prompt order; ``on_chunk`` is told of each as it is generated;
        ``episode``: multi-turn episodes, its ``items`` one per prompt (each chunk gets its own)."""
        ...

    async def regenerate(self, order: ChunkOrder) -> GenerateResult: ...

    async def score(
        self, results: Sequence[GenerateResult], metadata: Sequence[Sequence[dict[str, Any]]], endpoint: str
    ) -> list[ScoreResult]: ...

    async def configure_trainer(self, message: TrainerConfigure) -> TrainerConfigured: ...

    async def train_step(
        self, step: int, rollouts: Sequence[TensorRef], scores: Sequence[float], settings: StepSettings,
        groups: Sequence[Sequence[int]] | None = None,
    ) -> TrainStepResult: ...  # fmt: skip

    async def publish_weights(
        self, bucket_mb: float, weight_version: int = -1, *, carrier: CarrierSetting = "grpc",
        dtype: str = "", delta: bool = False,
    ) -> WeightsPublished: ...  # fmt: skip

    async def load_weights(
        self, published: WeightsPublished, keep_from_version: int = -1, *, hold: bool = False
    ) -> list[WeightsLoaded]: ...
    async def save(self, path: str, mode: Literal["hf", "full"] = "hf") -> str: ...
    async def load_checkpoint(self, path: str, weight_version: int) -> CheckpointLoaded: ...


# --- checkpoints ------------------------------------------------------------------------------------


class Checkpoints(Protocol):
    """Saving a run's full state and restoring it (:class:`~rlfleet.controller.run.FleetRun`)."""

    def save_checkpoint(self, path: Path) -> Path:
        """The trainer's full state and the controller's position, in ``path``."""
        ...

    def resume(self, path: Path, weight_version: int | None = None) -> None:
        """Restore the trainer and the run's position from the checkpoint ``path``; the weights go
        out as its version, or as ``weight_version``."""
        ...


# --- a step ---------------------------------------------------------------------------------------


class StepProgram(Protocol):
    """One algorithm family's step: what it asks of the tiers for one dataset batch
    (:class:`~rlfleet.controller.online.OnlineStep`, :class:`~rlfleet.controller.dpo.DPOStep`)."""

    last_routes: dict[str, Any]
    """Where the last step's prompts went (empty for a step that generates nothing)."""
    spare_batches: int
    """How many of the run's next batches a step may use besides its own (dynamic sampling's budget)."""
    extra_batches: int
    """How many of them the last step used: the run hands them out no more."""

    async def step(
        self, batch: list[PromptItem], fleet: FleetClient, upcoming: Sequence[list[PromptItem]] = ()
    ) -> dict[str, float]:
        """One step on ``batch``; ``upcoming`` (the run's next batches, as many as ``max_staleness``
        plus ``spare_batches``) may be begun while it trains or used in its own update."""
        ...


class KLController(Protocol):
    """What the run needs of its KL coefficient controller (:mod:`rlfleet.controller.online`): the
    value of the next step, settable between steps; each step's update; its state, for checkpoints."""

    kind: str
    value: float

    def update(self, current_kl: float, n_steps: int = 1) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
