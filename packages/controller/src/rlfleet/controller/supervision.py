"""Supervision in the embedded default (issue 12, point 5): the run's watched event loop, and what
the run does when a worker crashes.

Users drive training with plain calls (``trainer.steps()``, ``trainer.set_reward_fn(...)``); each
runs a coroutine on :class:`GuardedLoop` to the end. While it runs, the processes the run started
are checked four times a second (the run's :meth:`~rlfleet.controller.ports.Launcher.check`), so
a death is seen at once instead of when a request times out.

A **rollout or reward worker** is started again by the launcher, under the same id and config,
within ``faults.restart_budget`` (:meth:`~rlfleet.controller.launcher.RunProcesses.restarted`). The
run then forgets the dead process at once (a request in flight to it ends with ``WorkerGone`` and
its chunk goes to another worker), and before the next step waits for the new process to
announce when its tier has no other worker left (a rollout worker loads the trainer's current
weights before it announces: ``rollout/catch_up.py``; a stale one is loaded by the fleet before it
serves). A restarted reward worker serves what the run switched or swapped at run time, scaler
statistics included, from its ``state_dir`` (``reward/endpoint_state.py``). A
step that failed because of the crash before it reached the trainer is run again, with the same
prompts and sampling seed; a reward worker crashing mid-step interrupts the step at once (its
score requests went to the dead process and would only time out). Past the budget the run stops
with :class:`~rlfleet.controller.errors.TierNotRestarted`.

A rollout or reward worker that is **alive but frozen** (stopped with SIGSTOP, hung) does not exit:
the membership registry declares it dead when it is silent for ``faults.dead_after_s``. Before each
check of the launcher the run looks at whom the registry declared dead
(:meth:`Supervisor.kill_declared_dead`); a worker whose process still runs as the pid it announced
is SIGKILLed by its launcher (:func:`~rlfleet.controller.launcher.kill_declared_dead`), and the
check starts it again as above, within the same budget. Work it held waits for it meanwhile (a pool
momentarily empty: :meth:`rlfleet.controller.fleet.Fleet.pool_back`).

A **trainer** that crashes (``TierDied`` of the trainer), or answers with another incarnation
than the one the run configured (``TrainerRestarted``: restarted behind the run's back), has lost
the run's training state. With ``save_every`` set and a checkpoint written, the run starts the
trainer again (its ranks together), configures it, restores the latest ``checkpoint-<step>``
(the weights then go out under a new version, which every rollout worker loads), rewinds its
step counter, data position and KL controller to the checkpoint's, and goes on from there: the
steps after the checkpoint run again. Without a checkpoint it stops with ``TierNotRestarted``
naming why.

::

    step ──► crash? ── rollout/reward ──► launcher restarts it ──► step again (if it had not trained)
                   └── trainer ──► restart + configure ──► load checkpoint-<k> ──► steps k+1.. again

:class:`Supervisor` receives the ports it uses (:mod:`rlfleet.controller.ports`): the run's state,
its launcher and fleet client (once started), its checkpoints, its metrics and its loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from rlfleet.common.control.messages import TrainerConfigure, TrainStepResult
from rlfleet.common.errors import Failure, RemoteError, UserError
from rlfleet.controller.checkpoints import latest_checkpoint
from rlfleet.controller.errors import TierDied, TierNotReady, TierNotRestarted, TierRefused, TrainerRestarted
from rlfleet.controller.fleet import Fleet
from rlfleet.controller.launcher import WorkerProcess, kill_declared_dead
from rlfleet.controller.loggers import RunMetrics
from rlfleet.controller.ports import (
    Checkpoints,
    FleetClient,
    Launcher,
    RunState,
    StepProgram,
    describe_worker,
    not_ready,
)

if TYPE_CHECKING:
    from rlfleet.controller.dataset import PromptItem

logger = logging.getLogger(__name__)
T = TypeVar("T")

# --- the event loop: synchronous calls into async fleet code, watched for dying processes ---------


class GuardedLoop:
    """One event loop for a run; ``watch()`` gives the launcher to check (None: nothing to watch;
    its ``check`` raises TierDied for a death it does not recover from)."""

    def __init__(self, watch: Callable[[], Launcher | None]) -> None:
        self._watch = watch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.before_check: list[Callable[[], None]] = []
        """Called before each check of the launcher (the supervisor kills the frozen workers there)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop (a new one once the last was closed)."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine to its end, failing fast if a watched process dies."""
        task = self.loop.create_task(self._guarded(coro))
        self._tasks.add(task)  # kept if Ctrl-C leaves it pending, so close() can cancel it
        result = self.loop.run_until_complete(task)
        self._tasks.discard(task)
        return result

    def create_task(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Start ``coro`` in the background; it progresses while later calls run the loop."""
        return self.loop.create_task(coro, name=name)

    async def _guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` while watching; a request that fails because its worker died is reported as
        that death (:class:`TierDied`, caused by the request's error), not as its own error."""
        task = asyncio.ensure_future(coro)
        try:
            self._check()
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                self._check()
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # also when Ctrl-C left it failed
        error = None if task.cancelled() else task.exception()
        if error is not None and self._watch() is not None:
            try:
                for _ in range(10):  # a worker's sockets close a moment before its exit is visible
                    self._check()
                    await asyncio.sleep(0.1)
            except (TierDied, TierRefused) as died:
                raise died from error
        return task.result()

    def _check(self) -> None:
        for hook in self.before_check:
            hook()
        watched = self._watch()
        if watched is not None:
            watched.check()

    def shutdown(self, leave: Callable[[], Awaitable[None]] | None) -> None:
        """Cancel what a Ctrl-C left running, await ``leave()`` (10 s at most), then cancel and await
        every task still pending, end async generators and the default executor, so that closing
        the loop leaves nothing behind to fail later ("Event loop is closed", "Writer is closed").

        From here on the run is going away: what a task or callback fails with (a socket the other
        side closed, the KeyboardInterrupt of a SIGTERM that landed in a background task) is logged
        at debug level, not printed as a traceback."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.set_exception_handler(_quiet)
        _cancel(loop, list(self._tasks))
        self._tasks.clear()
        if leave is not None:
            try:
                loop.run_until_complete(asyncio.wait_for(leave(), timeout=10.0))
            except (ConnectionError, RuntimeError, TimeoutError) as exc:
                logger.debug("leaving the control plane: %s", exc)
        _drain(loop)

    def close(self) -> None:
        """Close the loop (idempotent), after cancelling and awaiting what is still pending on it."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            if not loop.is_running():
                loop.set_exception_handler(_quiet)
                _drain(loop)
            loop.close()


def _cancel(loop: asyncio.AbstractEventLoop, tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


_DRAIN_ROUNDS = 5
"""Cancelling a task can start another (a client's close); a few rounds catch those."""


def _drain(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel and await every pending task of ``loop`` (a few rounds), then its async generators and
    its default executor (a thread finishing after the loop closed would fail to report back)."""
    for _ in range(_DRAIN_ROUNDS):
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if not pending:
            break
        _cancel(loop, pending)
    for ending in (loop.shutdown_asyncgens(), loop.shutdown_default_executor()):
        try:
            loop.run_until_complete(asyncio.wait_for(ending, timeout=5.0))
        except (RuntimeError, TimeoutError) as exc:
            logger.debug("closing the run's event loop: %s", exc)


def _quiet(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler once the run stops: what fails now is a debug line, not a traceback."""
    error = context.get("exception")
    logger.debug("while the run stops: %s%s", context.get("message", ""), f" ({error!r})" if error else "")


# --- what a crash costs ---------------------------------------------------------------------------

REPLAYABLE = (Failure, RemoteError, ConnectionError, TimeoutError)
"""Errors of a step that a worker's crash explains (a request to it failed, timed out, found nobody,
a tier could not fetch what the dead worker held); a local user error never is one."""


class SupervisedFleet(Fleet):
    """The run's :class:`Fleet`, counting the train steps it asked for: a step that reached the
    trainer is never run twice."""

    train_requests = 0

    async def train_step(self, step: int, *args: Any, **kwargs: Any) -> TrainStepResult:
        self.train_requests += 1
        return await super().train_step(step, *args, **kwargs)


class StepInterrupted(Exception):
    """Raised from the launcher's check into the running step: a worker it waits on was restarted
    before the step reached the trainer, so the step runs again. Never leaves :class:`Supervisor`."""

    def __init__(self, died: TierDied) -> None:
        self.died = died
        super().__init__(str(died))


class Supervisor:
    """Restarts, rejoins, step replays and trainer restores for one run.

    ``fleet()`` and ``launcher()`` give the run's fleet client and launcher once it started (None
    before; no launcher when the run joined a fleet it did not start); ``checkpoints`` restores the
    trainer's state, ``configure()`` is what a new trainer is told before it serves."""

    def __init__(
        self, state: RunState, loop: GuardedLoop, metrics: RunMetrics, checkpoints: Checkpoints, *,
        fleet: Callable[[], FleetClient | None], launcher: Callable[[], Launcher | None],
        configure: Callable[[], TrainerConfigure],
    ) -> None:  # fmt: skip
        self.state = state
        self.loop = loop
        self.metrics = metrics
        self.checkpoints = checkpoints
        self._fleet = fleet
        self._launcher = launcher
        self._configure = configure
        self.rejoining: dict[tuple[str, str], str | None] = {}
        """Restarted workers not seen back yet: (tier, worker id) -> rollout pool (None: any)."""
        self._in_step = False
        self._crashed = False  # a worker was restarted during the running step
        self._mark = 0  # train requests when the running step began
        loop.before_check.append(self.kill_declared_dead)

    def attach(self, launcher: Launcher) -> None:
        launcher.on_restart = self.worker_restarted

    def fleet(self) -> FleetClient:
        """The run's fleet client (the run is started whenever the supervisor needs it)."""
        fleet = self._fleet()
        assert fleet is not None, "the run starts its fleet before it supervises a step"
        return fleet

    # --- rollout and reward workers ----------------------------------------------------------

    def worker_restarted(self, worker: WorkerProcess, died: TierDied) -> None:
        """Launcher callback: forget the dead process; interrupt a step that waits on a reward."""
        tier, worker_id = worker.spec.tier, worker.spec.worker_id
        pool = getattr(worker.spec.config, "pool", None) if tier == "rollout" else None
        self.rejoining[(tier, worker_id)] = pool
        fleet = self._fleet()
        if fleet is not None:
            fleet.forget(tier, worker_id)  # requests in flight to it end now, not at their timeout
        if self._in_step:
            self._crashed = True
            if tier == "reward" and not self._trained():
                raise StepInterrupted(died)

    def kill_declared_dead(self) -> None:
        """Have the launcher kill each rollout or reward worker that the registry declared dead while
        its process still runs (stopped, hung); its next check starts it again within the budget."""
        fleet = self._fleet()
        if fleet is None:
            return
        dead = fleet.registry.take_dead()
        launcher = self._launcher()
        if launcher is None:
            return  # a joined fleet: nobody here started its processes
        for info in dead:
            silent = fleet.registry.silent_for(info)
            kill_declared_dead(launcher.workers, info.tier, info.worker_id, info.announce.pid, silent)

    def _trained(self) -> bool:
        fleet = self._fleet()
        return isinstance(fleet, SupervisedFleet) and fleet.train_requests != self._mark

    async def rejoined(self) -> None:
        """Wait for the restarted workers whose tier (pool) has no live worker left."""
        fleet, timeout = self.fleet(), self.state.config.startup_timeout_s
        for (tier, worker_id), pool in list(self.rejoining.items()):
            info = fleet.registry.get(tier, worker_id)
            if info is None and not fleet.registry.workers(tier, pool):
                await self._wait_for(fleet, tier, worker_id, timeout)
                info = fleet.registry.get(tier, worker_id)
            if info is None:
                continue  # the others serve meanwhile; it is admitted when it announces
            del self.rejoining[(tier, worker_id)]
            logger.warning("%s worker %s is back (weight version %d)", tier, worker_id, info.weight_version)
            # A reward worker restores what the run switched and swapped (spec, reward model, scaler
            # statistics) from its state_dir (worker_configs.reward_worker_config): nothing is re-sent,
            # as re-sending RunReward.spec would undo an update_reward_model(dir) swap.

    async def _wait_for(self, fleet: FleetClient, tier: str, worker_id: str, timeout: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while fleet.registry.get(tier, worker_id) is None:
            if asyncio.get_running_loop().time() > deadline:
                missing = [describe_worker(self._launcher(), worker_id)]
                raise TierNotReady(timeout, missing, f"restarted {tier} worker {worker_id} did not announce")
            await asyncio.sleep(0.1)

    # --- a step ------------------------------------------------------------------------------

    def run_step(
        self, program: StepProgram, batch: list[PromptItem], upcoming: Sequence[list[PromptItem]] = ()
    ) -> dict[str, float] | None:
        """Run one step to its end (``upcoming``: the batches it may begin ahead), again after a
        worker's crash explains its failure; None when the trainer was restored from a checkpoint
        instead (the run goes on from there)."""
        while True:
            fleet = self.fleet()
            self._mark = fleet.train_requests if isinstance(fleet, SupervisedFleet) else 0
            self._in_step, self._crashed = True, False
            try:
                return self.loop.run(self._step(program, batch, fleet, upcoming))
            except StepInterrupted as exc:
                logger.warning("step %d interrupted: %s; running it again", self.state.global_step + 1, exc)
            except (TierDied, TrainerRestarted) as exc:
                self.restore_trainer(exc)
                return None
            except REPLAYABLE as exc:
                mine = isinstance(exc, UserError) and not isinstance(exc, RemoteError)
                if mine or not self._crashed or self._trained():
                    raise
                logger.warning("step %d failed after a worker restarted (%s); running it again",
                               self.state.global_step + 1, exc)  # fmt: skip
            finally:
                self._in_step = False

    async def _step(
        self, program: StepProgram, batch: list[PromptItem], fleet: FleetClient,
        upcoming: Sequence[list[PromptItem]],
    ) -> dict[str, float]:  # fmt: skip
        if self.rejoining:
            await self.rejoined()
        return await program.step(batch, fleet, upcoming)

    def guard(self, call: Callable[..., T], *args: Any) -> T | None:
        """``call(*args)``, or None when the trainer died during it and was restored from a checkpoint."""
        try:
            return call(*args)
        except (TierDied, TrainerRestarted) as exc:
            self.restore_trainer(exc)
            return None

    # --- the trainer ---------------------------------------------------------------------------

    def restore_trainer(self, cause: TierDied | TrainerRestarted) -> None:
        """Start the trainer again and restore the latest checkpoint, or raise why it cannot be."""
        state, cfg = self.state, self.state.config
        if isinstance(cause, TierNotRestarted) or (isinstance(cause, TierDied) and cause.tier != "trainer"):
            raise cause
        checkpoint = latest_checkpoint(state.output_dir) if cfg.save_every else None
        if checkpoint is None:
            why = (
                "save_every is not set, so there is no checkpoint to restore it from"
                if not cfg.save_every
                else f"no checkpoint is written yet (save_every={cfg.save_every}, at step "
                f"{state.global_step})"
            )
            if isinstance(cause, TrainerRestarted):
                raise cause
            raise TierNotRestarted(cause, f"the run cannot restore the trainer: {why}") from cause
        launcher = self._launcher()
        if launcher is not None and isinstance(cause, TierDied):
            launcher.restart_tier("trainer", cause)  # TierNotRestarted past the budget
        logger.warning("%s; restoring the trainer from %s", cause, checkpoint)
        self.loop.run(self._trainer_back())
        step = state.global_step
        self.checkpoints.resume(checkpoint, weight_version=state.weight_version + 1)
        self.metrics.rewind(state.global_step)  # the steps after it are logged again, each once
        self.metrics.say(
            f"rlfleet: the trainer was restored from {checkpoint.name} after: {cause}; steps "
            f"{state.global_step + 1}..{step + 1} run again"
        )

    async def _trainer_back(self) -> None:
        """Forget the trainer that is gone, wait for the new one to announce, configure it."""
        fleet = self.fleet()
        for worker in fleet.registry.workers("trainer"):
            fleet.forget("trainer", worker.worker_id)
        timeout = self.state.config.startup_timeout_s
        try:
            await fleet.wait_ready({"trainer": 1}, timeout)
        except TimeoutError as exc:
            raise not_ready(self._launcher(), fleet.registry, timeout, str(exc)) from None
        await fleet.configure_trainer(self._configure())
