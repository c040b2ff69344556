"""Every error rlfleet-reward raises, in one place.

Spec mistakes (an unknown rule, a bad argument, a user function that cannot be imported, a reward
model directory that does not load) are ``ValueError`` s, raised when a spec is parsed or built,
before any sample is scored. Failures while scoring are ``RuntimeError`` s that name the reward
component and the sample index. Refusals of the service (no or a wrong token, an endpoint the
tenant may not use, a quota overrun) carry a ``code`` that the transport sends as the
``ErrorReply`` code. Each error keeps its fields and builds its own message.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from rlfleet.common.errors import Failure, UserError


class RewardError(UserError):
    """Marker base for every rlfleet-reward error; never raised on its own."""


# --- user mistakes: the spec ----------------------------------------------------------------


class RewardSpecError(RewardError, ValueError):
    """A reward spec is malformed (syntax of the string form, shape of the dict form)."""

    def __init__(self, spec: object, reason: str) -> None:
        self.spec = spec
        self.reason = reason
        super().__init__(f"bad reward spec {spec!r}: {reason}")


class UnknownReward(RewardError, ValueError):
    """A component names neither a registered rule nor a ``module:function``."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(
            f"unknown reward {name!r}: registered rules are {', '.join(self.known)}; "
            "a user function is written 'package.module:function'"
        )


class UnknownRewardArgument(RewardError, ValueError):
    """A component is given an argument its rule or function does not take."""

    def __init__(self, reward: str, argument: str, accepted: Iterable[str]) -> None:
        self.reward = reward
        self.argument = argument
        self.accepted = sorted(accepted)
        listed = ", ".join(self.accepted) or "none"
        super().__init__(f"reward {reward!r} takes no argument {argument!r} (it accepts: {listed})")


class BadRewardArgument(RewardError, ValueError):
    """An argument's value is missing, of the wrong type or out of range.

    ``missing``: the rule needs ``argument`` and it was not given (``value`` and ``reason`` unused);
    an empty ``argument`` is a check across several arguments (``value``: all of them).
    """

    def __init__(
        self, reward: str, argument: str, value: object = None, reason: str = "", *, missing: bool = False
    ) -> None:
        self.reward = reward
        self.argument = argument
        self.value = value
        self.reason = reason
        self.missing = missing
        if missing:
            message = f"reward {reward!r} needs the argument {argument!r}, e.g. '{reward}:{argument}=...'"
        elif argument:
            message = f"reward {reward!r}: argument {argument}={value!r} is invalid: {reason}"
        else:
            message = f"reward {reward!r}: arguments {value!r} are invalid: {reason}"
        super().__init__(message)


class RewardImportError(RewardError, ValueError):
    """A user function ``module:function`` cannot be imported, or is not a usable callable."""

    def __init__(self, target: str, reason: str) -> None:
        self.target = target
        self.reason = reason
        super().__init__(f"cannot load reward function {target!r}: {reason}")


class NoScorer(RewardError, ValueError):
    """A :class:`RewardScaler` was asked to compute rewards but has neither a scorer nor a model."""

    def __init__(self, model_name: str | None) -> None:
        self.model_name = model_name
        super().__init__(
            "RewardScaler has no scorer: pass model_name=<reward model directory>, or fn=... (any "
            "callable (prompts, responses, **kw) -> list[float], e.g. build_reward(spec)), or use .wrap(fn)"
        )


class RewardModelError(RewardError, ValueError):
    """A reward model (or sentence encoder) cannot be loaded, or does not fit its options."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"reward model {path!r}: {reason}")


class NotPortable(RewardError, ValueError):
    """A reward function cannot be described as a spec, so it cannot be sent to a reward server."""

    def __init__(self, what: str, reason: str) -> None:
        self.what = what
        self.reason = reason
        super().__init__(f"{what} cannot be sent to a reward server: {reason}")


# --- user mistakes: the inputs --------------------------------------------------------------


class RewardInputError(RewardError, ValueError):
    """Inputs to score do not fit (lengths differ, metadata a rule needs is missing, NaN scores)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


# --- runtime failures -----------------------------------------------------------------------


class RewardFunctionError(RewardError, RuntimeError):
    """A reward component raised, or returned something that is not a finite number, on one sample."""

    def __init__(self, function: str, index: int | None, reason: str) -> None:
        self.function = function
        self.index = index
        self.reason = reason
        where = "the batch" if index is None else f"sample {index}"
        super().__init__(f"reward {function!r} failed on {where}: {reason}")


class UnknownEndpoint(RewardError, KeyError):
    """A score request names an endpoint this reward server does not serve."""

    code = "unknown_endpoint"

    def __init__(self, endpoint: str, known: Iterable[str]) -> None:
        self.endpoint = endpoint
        self.known = sorted(known)
        super().__init__(f"reward endpoint {endpoint!r} is not served here; known endpoints: {self.known}")

    def __str__(self) -> str:
        return str(self.args[0])


class RewardStateError(RewardError, ValueError):
    """A file of the reward server's ``state_dir`` cannot be used: unreadable, not what the server
    writes, or its spec no longer builds. The server refuses to start rather than serve something else."""

    def __init__(self, path: object, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(
            f"reward state file {self.path} is unusable: {reason}; fix it or remove it "
            "(the endpoint then starts from the config, or is gone if the config does not name it)"
        )


class TenantConfigError(RewardError, ValueError):
    """The tenants or the admin token of a server's config cannot work (a token variable unset or
    too short, two of them sharing a token): the server refuses to start."""

    def __init__(self, who: str, reason: str) -> None:
        self.who = who
        self.reason = reason
        super().__init__(f"{who}: {reason}")


# --- refusals of the service (each has its own wire code) -----------------------------------


class MissingToken(RewardError, PermissionError):
    """A request to a server with tenants carries no token."""

    code = "missing_token"

    def __init__(self, operation: str) -> None:
        self.operation = operation
        super().__init__(
            f"{operation} needs a tenant token: set ScoreRequest.token (reward_token in the config)"
        )


class InvalidToken(RewardError, PermissionError):
    """A request's token belongs to no tenant (and is not the admin token)."""

    code = "invalid_token"

    def __init__(self, operation: str) -> None:
        self.operation = operation
        super().__init__(f"{operation}: the token is not valid on this reward server")


class ForbiddenEndpoint(RewardError, PermissionError):
    """A tenant asked for an endpoint (or an environment: ``what``) it may not use, existing or not."""

    code = "forbidden_endpoint"

    def __init__(self, tenant: str, endpoint: str, allowed: Iterable[str], what: str = "endpoint") -> None:
        self.tenant = tenant
        self.endpoint = endpoint
        self.allowed = sorted(allowed)
        self.what = what
        super().__init__(
            f"tenant {tenant!r} may not use {what} {endpoint!r}; its endpoints are {self.allowed}"
        )


class ForbiddenOperation(RewardError, PermissionError):
    """A caller asked for something it may not do: a swap by a tenant without ``can_update``, a
    ``Shutdown`` without the admin token, a tenant's spec naming code of a module the server does
    not admit (``allowed_modules``), a request naming a TensorStore outside the tenant's ``stores``.

    ``allowed`` (with ``allowed_what``, what they are) lists what the tenant may use instead; without
    it the message sends the caller to the server's operator.
    """

    code = "forbidden"

    def __init__(
        self, tenant: str, operation: str, allowed: Iterable[str] | None = None, allowed_what: str = ""
    ) -> None:
        self.tenant = tenant
        self.operation = operation
        self.allowed = None if allowed is None else sorted(allowed)
        self.allowed_what = allowed_what
        if self.allowed is None:
            advice = "ask the reward server's operator"
        else:
            advice = f"{allowed_what or 'allowed'}: {self.allowed}"
        super().__init__(f"tenant {tenant!r} may not {operation}; {advice}")


class QuotaExceeded(RewardError, RuntimeError):
    """A tenant is over one of its quotas for now: its ``requests_per_s`` rate (``limit`` requests a
    second; retry after ``retry_after_s``), its ``concurrency`` (``limit`` requests in progress;
    retry when one finishes), its ``bytes_in_flight`` (``limit`` bytes of texts held at once) or its
    ``episodes`` (``limit`` live environment episodes in one replica)."""

    code = "quota_exceeded"
    retryable = True

    def __init__(
        self,
        tenant: str,
        quota: Literal["requests_per_s", "concurrency", "bytes_in_flight", "episodes"],
        limit: float,
        retry_after_s: float = 0.0,
    ) -> None:
        self.tenant = tenant
        self.quota = quota
        self.limit = limit
        self.retry_after_s = retry_after_s
        if quota == "concurrency":
            detail = f"already has {limit:g} requests in progress (its concurrency); retry when one finishes"
        elif quota == "episodes":
            detail = (f"holds {limit:g} live episodes in this replica (its share of max_episodes); close "
                      "finished ones (EnvClose) or retry when one ends")  # fmt: skip
        elif quota == "bytes_in_flight":
            detail = (f"would hold more than {limit:g} bytes of texts at once (its bytes_in_flight); retry "
                      "when one of its requests finishes")  # fmt: skip
        else:
            detail = f"is over its quota of {limit:g} requests/s; retry in {retry_after_s:.2f}s"
        super().__init__(f"tenant {tenant!r} {detail}")


class QuotaStoreMissing(RewardError, RuntimeError):
    """``quota_store: nats`` but the NATS server offers no usable JetStream key-value bucket (at start)."""

    def __init__(self, bucket: str, reason: str) -> None:
        self.bucket = bucket
        self.reason = reason
        super().__init__(
            f"tenant quotas are shared through the JetStream key-value bucket {bucket!r} (quota_store: "
            f"nats), but {reason}; enable JetStream on the NATS server (nats-server -js, or a jetstream "
            "{} block, for the reward server's account and user), or set quota_store: process to count "
            "each replica alone (a single replica only)"
        )


class QuotaStoreUnavailable(Failure, ConnectionError):
    """The shared quota bucket did not answer while a request was counted; the request is not served.

    A runtime failure, not a tenant's mistake (so not a :class:`RewardError`); retryable.
    """

    code = "unavailable"
    retryable = True

    def __init__(self, bucket: str, reason: str) -> None:
        self.bucket = bucket
        self.reason = reason
        super().__init__(
            f"the shared quota store (JetStream key-value bucket {bucket!r}) is unreachable: {reason}; "
            "the request was not served, retry"
        )


class BatchTooLarge(RewardError, ValueError):
    """A request holds more samples than the tenant's ``max_batch``."""

    code = "batch_too_large"

    def __init__(self, tenant: str, samples: int, max_batch: int) -> None:
        self.tenant = tenant
        self.samples = samples
        self.max_batch = max_batch
        super().__init__(
            f"tenant {tenant!r} sent {samples} samples in one request; its max_batch is {max_batch}: "
            "split the batch"
        )


class TextsTooLarge(RewardError, ValueError):
    """A tenant's request would make the server fetch more text than it may: one sample over its
    ``sample_bytes``, the request over its ``request_bytes`` (both as the store declared the sizes),
    or its store sending more than it declared (``declared_bytes``: cut off before it is allocated)."""

    code = "batch_too_large"

    def __init__(
        self,
        tenant: str,
        limit: Literal["sample_bytes", "request_bytes", "declared_bytes"],
        nbytes: int,
        cap: int,
    ) -> None:
        self.tenant = tenant
        self.limit = limit
        self.nbytes = nbytes
        self.cap = cap
        if limit == "declared_bytes":
            detail = f"its store sent {nbytes} bytes where it declared {cap}; the fetch was cut off"
        else:
            what = "one sample holds" if limit == "sample_bytes" else "the request's texts take"
            detail = f"{what} {nbytes} bytes, over its {limit} of {cap}"
        super().__init__(
            f"tenant {tenant!r}: {detail}; nothing was scored (split the batch, or shorten the texts)"
        )


class DeadlinePassed(RewardError, TimeoutError):
    """A score request's deadline passed (its own ``deadline``, or the tenant's ``request_s``) before
    the work was done: the server stopped it (at the next step: the fetch, or the next slice of
    samples) and scored nothing for it."""

    code = "timeout"

    def __init__(self, job_id: str, when: str, late_s: float) -> None:
        self.job_id = job_id
        self.when = when
        self.late_s = late_s
        super().__init__(
            f"score job {job_id!r}: its deadline passed {late_s:.2f}s ago {when}; the work was stopped"
        )


# --- environments ---------------------------------------------------------------------------


class EnvironmentSpecError(RewardError, ValueError):
    """The operator's environment spec cannot be built: bad syntax, an unknown environment or tool, a
    bad option. Raised when the reward worker starts, before it serves anything."""

    def __init__(self, endpoint: str, spec: object, reason: str) -> None:
        self.endpoint = endpoint
        self.spec = spec
        self.reason = reason
        super().__init__(f"environment {endpoint!r} (spec {spec!r}): {reason}")


class UnknownEnvironment(RewardError, KeyError):
    """A request names an environment this reward server does not run (only its operator adds them)."""

    code = "unknown_endpoint"

    def __init__(self, environment: str, known: Iterable[str]) -> None:
        self.environment = environment
        self.known = sorted(known)
        super().__init__(
            f"environment {environment!r} is not run here (a reward server runs only the environments its "
            f"operator configured); environments: {self.known}"
        )

    def __str__(self) -> str:
        return str(self.args[0])


class BadEnvironmentItem(RewardError, ValueError):
    """An episode's dataset item lacks what its environment needs (``bad_request``)."""

    def __init__(self, environment: str, reason: str) -> None:
        self.environment = environment
        self.reason = reason
        super().__init__(f"environment {environment!r} cannot start an episode: {reason}")


class UnknownEpisode(RewardError, KeyError):
    """A step names an episode this worker does not hold for the caller (``bad_request``)."""

    def __init__(self, episode_id: str, environment: str, worker_id: str) -> None:
        self.episode_id = episode_id
        self.environment = environment
        self.worker_id = worker_id
        super().__init__(
            f"reward worker {worker_id} holds no episode {episode_id!r} of environment {environment!r} for "
            "you: never reset here, done, closed, or dropped (idle past episode_idle_s, or past its step "
            "deadline); reset a new one"
        )

    def __str__(self) -> str:
        return str(self.args[0])


class EpisodeBusy(RewardError, RuntimeError):
    """A step reached an episode while its previous step was still running (``bad_request``)."""

    def __init__(self, episode_id: str) -> None:
        self.episode_id = episode_id
        super().__init__(f"episode {episode_id!r} is still taking a step: send its steps one at a time")


class EpisodesFull(Failure, RuntimeError):
    """The worker holds ``max_episodes`` live episodes; another replica may have room (retryable)."""

    code = "unavailable"
    retryable = True

    def __init__(self, worker_id: str, limit: int) -> None:
        self.worker_id = worker_id
        self.limit = limit
        super().__init__(
            f"reward worker {worker_id} holds {limit} live episodes (its max_episodes); retry (another "
            "replica may take it) or close finished episodes"
        )


class StepDeadlinePassed(RewardError, TimeoutError):
    """An episode's reset or step ran past its deadline (the environment's ``step_s``, the request's own
    ``deadline``, a tenant's ``request_s``): the episode is dropped, so a retry cannot succeed."""

    code = "timeout"
    retryable = False

    def __init__(self, episode_id: str, seconds: float) -> None:
        self.episode_id = episode_id
        self.seconds = seconds
        super().__init__(
            f"episode {episode_id!r}: its step did not finish within its deadline ({seconds:.1f}s); the "
            "episode is dropped"
        )


class SandboxUnavailable(RewardError, RuntimeError):
    """The sandbox an environment's settings ask for cannot run on this host (at the worker's start)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"the python tool's sandbox cannot run here: {reason}")


class ToolFailed(RewardError, RuntimeError):
    """A tool the model called failed (bad arithmetic, code that raised or hit a sandbox limit): never
    a reply's error, its text becomes the episode's ``tool error: ...`` observation."""

    def __init__(self, tool: str, reason: str) -> None:
        self.tool = tool
        self.reason = reason
        super().__init__(f"{tool}: {reason}")
