"""Every error rlfleet-rollout raises, in one place.

Each error subclasses a builtin and one of :class:`~rlfleet.common.errors.UserError` (a bad prompt,
an unknown engine or weight name, a missing or unsupported vLLM, a request over the worker's
limits) or :class:`~rlfleet.common.errors.Failure` (an engine used after ``close()``, stale or
discarded weights, a publish cut short, a job past its deadline, an episode's environment request).
Each keeps its fields and builds its own message.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlfleet.common.errors import Failure, UserError


class UnknownEngine(UserError, ValueError):
    """``make_engine`` was asked for an engine name that is not registered."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        self.name = name
        self.known = tuple(known)
        super().__init__(f"unknown rollout engine {name!r}; registered engines: {', '.join(self.known)}")


class InvalidPrompt(UserError, ValueError):
    """A prompt given to ``generate`` cannot be generated from: it is empty, holds token ids outside
    the vocabulary (``reason`` says which), or with ``max_tokens`` does not fit the engine's context
    cap (``cap``: ``rollout.engine.max_model_len``, bounded by the model's ``max_position_embeddings``).

    A long prompt is refused, never truncated: a truncated prompt would silently train on text the
    user did not write. Shorten prompts (``max_prompt_length``) or raise the cap.
    """

    def __init__(
        self, index: int, reason: str = "", *, prompt_len: int = 0, max_tokens: int = 0, cap: int = 0
    ) -> None:
        self.index = index
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.cap = cap
        if cap:
            reason = (
                f"has {prompt_len} tokens; with max_tokens={max_tokens} it needs {prompt_len + max_tokens} > "
                f"the context cap of {cap} tokens (rollout.engine.max_model_len, bounded by the model's "
                "max_position_embeddings); shorten prompts or raise the cap"
            )
        self.reason = reason
        super().__init__(f"prompt {index}: {reason}")


class UnknownWeight(UserError, KeyError):
    """``load_weights`` got tensor names the model does not have."""

    def __init__(
        self, names: Sequence[str], suggestions: dict[str, list[str]], examples: Sequence[str]
    ) -> None:
        self.names = tuple(names)
        self.suggestions = suggestions
        self.examples = tuple(examples)
        shown = ", ".join(
            f"{n!r}" + (f" (did you mean {suggestions[n][0]!r}?)" if suggestions.get(n) else "")
            for n in self.names[:5]
        )
        more = f" and {len(self.names) - 5} more" if len(self.names) > 5 else ""
        super().__init__(
            f"{len(self.names)} unknown weight name(s): {shown}{more}; the model's names look like "
            f"{', '.join(repr(e) for e in self.examples)} (HF state_dict names, no wrapper prefixes)"
        )

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence readable
        return str(self.args[0])


class WeightShapeMismatch(UserError, ValueError):
    """A tensor given to ``load_weights`` has another shape than the parameter it targets."""

    def __init__(self, name: str, expected: tuple[int, ...], actual: tuple[int, ...]) -> None:
        self.name = name
        self.expected = tuple(expected)
        self.actual = tuple(actual)
        super().__init__(
            f"weight {name!r}: shape {list(self.actual)} does not match the model's {list(self.expected)} "
            "(send full, unsharded tensors)"
        )


class WeightDtypeMismatch(UserError, TypeError):
    """A tensor cannot be cast to its parameter's dtype (e.g. integers into a float parameter)."""

    def __init__(self, name: str, expected: str, actual: str) -> None:
        self.name = name
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"weight {name!r}: dtype {actual} cannot be loaded into a {expected} parameter "
            "(floating-point casts are allowed, other kinds are not)"
        )


class EngineClosed(Failure, RuntimeError):
    """An engine was used after ``close()``."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        super().__init__(f"rollout engine for {model_id!r} is closed")


class StaleWeights(Failure, RuntimeError):
    """A generate request asked for a weight version this worker does not hold (yet)."""

    code = "stale_weights"
    retryable = True

    def __init__(self, worker_id: str, held: int, asked: int) -> None:
        self.worker_id = worker_id
        self.held = held
        self.asked = asked
        super().__init__(
            f"rollout worker {worker_id} holds weight version {held}, the request asks for {asked}"
        )


class DeltaBaseMissing(Failure, ValueError):
    """A weight delta came for a version this worker does not hold a copy of (the sender then sends
    the whole version)."""

    code = "delta_base"
    retryable = False

    def __init__(self, worker_id: str, held: int | None, base: int) -> None:
        self.worker_id = worker_id
        self.held = held
        self.base = base
        holds = f"holds a copy of version {held}" if held is not None else "holds no copy of its weights"
        super().__init__(f"rollout worker {worker_id} {holds}; the delta applies to version {base}")


class BadAdapter(UserError, ValueError):
    """A published LoRA adapter the engine cannot apply (``tensor``: the adapter tensor at fault, by
    its PEFT name; ``reason`` says why). Checked whole before anything changes: the engine keeps the
    version it serves."""

    def __init__(self, tensor: str, reason: str) -> None:
        self.tensor = tensor
        self.reason = reason
        super().__init__(f"LoRA adapter refused: {tensor + ': ' if tensor else ''}{reason}")


class IncompleteWeights(Failure, ValueError):
    """A weight version was set while a fused block still missed some of its tensors.

    vLLM fuses several HF tensors into one kernel tensor (q/k/v, gate/up), so it loads a
    transformer block only once every tensor of the block has arrived.
    """

    def __init__(self, missing: Sequence[str]) -> None:
        self.missing = tuple(missing)
        shown = ", ".join(repr(n) for n in self.missing[:5])
        more = f" and {len(self.missing) - 5} more" if len(self.missing) > 5 else ""
        super().__init__(
            f"weights of a partly sent block were dropped: {len(self.missing)} tensor(s) never came, "
            f"{shown}{more}; "
            "send every tensor of a transformer block (any bucket order) before setting the version"
        )


class WeightsDiscarded(Failure, RuntimeError):
    """The engine slept at level 2 (weights discarded) and has not received a full publish since."""

    def __init__(self, model_id: str, missing: int) -> None:
        self.model_id = model_id
        self.missing = missing
        super().__init__(
            f"engine for {model_id!r} discarded its weights in a level-2 sleep and {missing} weight "
            "group(s) have not been published since; publish the weights before generating"
        )


class WeightsTorn(Failure, RuntimeError):
    """A weight load failed partway through changing the engine's weights, which it cannot undo.

    The vLLM engine reloads whole blocks inside vLLM's workers and keeps no copy of what it
    replaced: once a load breaks off after some blocks went in, the engine holds a mix of two
    versions. It refuses to generate from then on (instead of serving the mix under the version it
    reports) until a load that sends those blocks again succeeds.
    """

    def __init__(self, model_id: str, groups: int, reason: str) -> None:
        self.model_id = model_id
        self.groups = groups
        self.reason = reason
        super().__init__(
            f"engine for {model_id!r}: a weight load failed partway ({reason}); {groups} weight "
            "group(s) may hold a mix of two versions, so generation is refused until a full load "
            "of the weights succeeds"
        )


class EngineUnavailable(UserError, ImportError):
    """The requested engine cannot run here (its package is missing or built for another device)."""

    def __init__(self, name: str, reason: str) -> None:
        self.engine = name
        self.reason = reason
        super().__init__(f"rollout engine {name!r} is unavailable: {reason}")


class IpcUnavailable(UserError, ValueError):
    """A CUDA IPC weight bucket cannot be used here (another GPU, no CUDA, a malformed handle)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"cannot load weights over CUDA IPC: {reason}")


class NoUsableCarrier(Failure, ValueError):
    """A weight load offered no carrier this worker can use (IPC buckets for another GPU, no gRPC ones)."""

    def __init__(self, worker_id: str, version: int, reason: str) -> None:
        self.worker_id = worker_id
        self.version = version
        self.reason = reason
        super().__init__(f"rollout worker {worker_id} cannot load weight version {version}: {reason}")


class UnsupportedVLLM(UserError, ImportError):
    """The installed vLLM is outside the range this engine is tested with."""

    def __init__(self, version: str, supported: str) -> None:
        self.version = version
        self.supported = supported
        super().__init__(
            f"vLLM {version} is installed, but rlfleet's vLLM engine supports {supported}; install a "
            "release in that range (or set RLFLEET_VLLM_ANY_VERSION=1 to try it anyway)"
        )


class GenerateTooLarge(UserError, ValueError):
    """A generate request whose fields are each in bounds asks for more in all than this worker allows:
    ``product`` (samples, new tokens, prompt tokens) is ``value``, over ``limit`` (the worker's
    ``limits.<setting>``). Refused before any work; the wire code is ``bad_request``."""

    def __init__(self, product: str, formula: str, value: int, limit: int, setting: str) -> None:
        self.product = product
        self.value = value
        self.limit = limit
        self.setting = setting
        super().__init__(
            f"the request asks for {value} {product} ({formula}), over this worker's limit of {limit} "
            f"(limits.{setting}); split it into smaller requests or raise the limit"
        )


class DeadlinePassed(Failure, TimeoutError):
    """A generate job's deadline (``GenerateRequest.deadline``) passed: the job was refused before it
    started (``ran_s`` None), or its generation was cancelled after ``ran_s`` seconds (the HF engine
    between decode steps, the vLLM engine by aborting its requests) and the worker is free again.

    Retryable (wire code ``timeout``): the requester's next try carries a fresh deadline. The reply
    goes out either way; a requester that is gone never reads it.
    """

    code = "timeout"
    retryable = True

    def __init__(self, what: str, late_s: float, ran_s: float | None = None) -> None:
        self.what = what
        self.late_s = late_s
        self.ran_s = ran_s
        outcome = ("refused before it started" if ran_s is None
                   else f"cancelled after {ran_s:.1f} s of generation")  # fmt: skip
        super().__init__(f"{what}: its deadline passed {late_s:.1f} s ago; {outcome}")


class EnvRefused(UserError, PermissionError):
    """The reward servers refused this run the environment: no token, a token they do not know, an
    environment its tenant may not use or they do not serve (``code``: their refusal). Every episode
    would fail the same way, so the job fails with it (a ``bad_request`` reply) instead of training
    on rewards of 0. ``refusal``: the servers' code (not ``code``, which would make it this reply's)."""

    def __init__(self, env: str, refusal: str, reason: str) -> None:
        self.env = env
        self.refusal = refusal
        self.reason = reason
        super().__init__(
            f"the reward servers refused environment {env!r} ({refusal}): {reason}; check environment.env, "
            "reward.token (or RLFLEET_REWARD_TOKEN) and the tenant's endpoints on the server"
        )


class EnvFailed(Failure, RuntimeError):
    """An environment request of an episode failed (``step``: reset, step or close; ``reason``: a
    timeout, an error reply, a worker gone, a reply that does not fit). It ends that episode with
    reward 0, counted in the batch's ``episode_end``; the job goes on."""

    def __init__(self, env: str, episode_id: str, step: str, reason: str) -> None:
        self.env = env
        self.episode_id = episode_id
        self.step = step
        self.reason = reason
        super().__init__(f"environment {env!r}, episode {episode_id}: {step} failed: {reason}")
