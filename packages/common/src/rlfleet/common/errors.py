"""Every error rlfleet-common raises, in one place.

Each error subclasses a builtin so callers can catch broadly (``ValueError``) or precisely
(``ChecksumMismatch``). Errors keep their fields and build their own message. User mistakes
(bad config, bad input) are kept apart from runtime failures (timeouts, lost peers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class RlfleetError(Exception):
    """Marker base for every rlfleet error; never raised on its own.

    Every error is also a :class:`UserError` (the user can fix it: a bad config, a missing model or
    checkpoint, a bad reward spec or input; ``rlfleet`` exits 2 with its one-line message) or a
    :class:`Failure` (something broke at run time: a peer died, a wait ran out; exit 1).
    """


class UserError(RlfleetError):
    """Base of the user's mistakes (see :class:`RlfleetError`)."""


class Failure(RlfleetError):
    """Base of runtime failures (see :class:`RlfleetError`)."""


REFUSES = "refuses this run's settings: "


class SettingsConflict(UserError, ValueError):
    """A worker refuses a run whose fixed settings differ from its own (wire code ``settings_conflict``).

    The worker raises it with ``conflicts``: ``(field, run's value, worker's value)``, each value
    already written for people. The controller raises it again from the worker's reply
    (:meth:`from_reply`), whose text becomes the ``detail``, with advice for the user. One line
    either way.
    """

    code = "settings_conflict"

    def __init__(self, worker: str, conflicts: Sequence[tuple[str, str, str]] = (), *, tier: str = "trainer",
                 detail: str | None = None, advice: str = "") -> None:  # fmt: skip
        self.tier = tier
        self.worker = worker
        self.conflicts = list(conflicts)
        text = detail if detail is not None else "; ".join(f"{f}: run {run}, worker {mine}"
                                                           for f, run, mine in self.conflicts)  # fmt: skip
        self.detail = " ".join(text.split())  # one line, whatever the worker wrote
        super().__init__(f"{tier} worker {worker} {REFUSES}{self.detail}{advice}")

    @classmethod
    def from_reply(cls, tier: str, worker: str, text: str) -> SettingsConflict:
        """The conflict a worker's error reply reports (its own account of the fields, without the
        sentence this class wraps it in, where the worker used it)."""
        detail = text.split(REFUSES, 1)[1] if REFUSES in text else text
        advice = ". Set them in the job to the worker's values, or restart the worker with the run's"
        return cls(worker, tier=tier, detail=detail, advice=advice)


@dataclass(frozen=True)
class WireCode:
    """One error code of :class:`ErrorReply`: whether retrying can help and whose mistake it is."""

    retryable: bool
    user_error: bool
    meaning: str


WIRE_CODES: dict[str, WireCode] = {
    "protocol_mismatch": WireCode(False, True, "the peers speak different MAJOR wire versions"),
    "bad_message": WireCode(False, True, "the request could not be decoded or is malformed"),
    "too_large": WireCode(False, True, "the message is over the control plane's size limit"),
    "bad_request": WireCode(False, True, "the request is well formed but not acceptable (a user error)"),
    "settings_conflict": WireCode(False, True, "a worker's fixed settings differ from the run's"),
    "timeout": WireCode(True, False, "a wait inside the worker ran out"),
    "unavailable": WireCode(True, False, "a peer the worker needs is gone or unreachable"),
    "stale_weights": WireCode(True, False, "the worker does not hold the requested weight version yet"),
    "delta_base": WireCode(False, False, "the worker does not hold the version a weight delta applies to"),
    "quota_exceeded": WireCode(True, True, "the tenant is over its quota for now"),
    "unknown_endpoint": WireCode(False, True, "no reward endpoint of that name"),
    "missing_token": WireCode(False, True, "the request carries no credential"),
    "invalid_token": WireCode(False, True, "the credential is not valid"),
    "forbidden_endpoint": WireCode(False, True, "the tenant may not use that endpoint"),
    "forbidden": WireCode(False, True, "the caller may not do that"),
    "batch_too_large": WireCode(False, True, "the batch is over the endpoint's limit"),
    "internal": WireCode(False, False, "the worker failed (a bug or a crash); see its log"),
}
"""Every :class:`ErrorReply` code, in one table (``code`` of an error class, else by its base)."""


def wire_code(exc: BaseException) -> tuple[str, bool]:
    """The ``(code, retryable)`` an :class:`ErrorReply` carries for ``exc``.

    An error's own ``code`` (and ``retryable``) attributes win; then its kind: protocol and
    decode errors, timeouts, lost connections, other user errors (``bad_request``); else ``internal``.
    """
    code = getattr(exc, "code", None)
    if not (isinstance(code, str) and code in WIRE_CODES):
        code = next((c for kind, c in _BY_KIND if isinstance(exc, kind)), "internal")
    retryable = getattr(exc, "retryable", None)
    return code, retryable if isinstance(retryable, bool) else WIRE_CODES[code].retryable


# --- user mistakes --------------------------------------------------------------------------


class ConfigError(UserError, ValueError):
    """A config file or override is malformed; names the field path and the bad value."""

    def __init__(self, path: str, value: object, reason: str) -> None:
        self.path = path
        self.value = value
        self.reason = reason
        super().__init__(f"config field {path!r} = {value!r}: {reason}")


# --- control plane --------------------------------------------------------------------------


class ProtocolMismatch(UserError, ValueError):
    """A message speaks another MAJOR version of the wire schema."""

    def __init__(self, ours: str, theirs: str) -> None:
        self.ours = ours
        self.theirs = theirs
        self.sender: dict[str, str] = {}  # who sent it, as far as the refused message says (codec.decode)
        super().__init__(
            f"wire protocol mismatch: this process speaks {ours}, the message is {theirs} "
            "(MAJOR versions must match; upgrade the older side)"
        )


class MessageDecodeError(UserError, ValueError):
    """Bytes that arrived are not a valid control message."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"cannot decode control message: {reason}")


class MessageTooLarge(UserError, ValueError):
    """A message (or chunk) is over the size limit of its transport; ``hint`` says what to do instead."""

    def __init__(self, size: int, limit: int, what: str = "message", hint: str = "") -> None:
        self.size = size
        self.limit = limit
        self.what = what
        self.hint = hint
        advice = hint or "send bulk data over the gRPC tensor plane and pass a TensorRef instead"
        super().__init__(f"{what} of {size} bytes is over the {limit}-byte limit; {advice}")


class RequestTimeout(Failure, TimeoutError):
    """No reply came on a subject in time."""

    def __init__(self, subject: str, tier: str, timeout: float) -> None:
        self.subject = subject
        self.tier = tier
        self.timeout = timeout
        super().__init__(
            f"no reply from the {tier} tier on {subject!r} within {timeout:g}s "
            "(is a worker of that tier running and connected?)"
        )


class NoResponders(Failure, ConnectionError):
    """Nobody listens on a subject."""

    def __init__(self, subject: str, tier: str) -> None:
        self.subject = subject
        self.tier = tier
        super().__init__(f"no {tier} worker is subscribed to {subject!r}")


class RemoteError(RlfleetError, RuntimeError):
    """A peer answered with an ErrorReply; raised as :class:`RemoteUserError` or :class:`RemoteFailure`
    according to its code (:data:`WIRE_CODES`), see :func:`remote_error`."""

    def __init__(
        self, tier: str, code: str, message: str, retryable: bool = False, retry_after_s: float = 0.0
    ) -> None:
        self.tier = tier
        self.code = code
        self.remote_message = message
        self.retryable = retryable
        self.retry_after_s = retry_after_s  # the peer's own wait before a retry (0: none asked)
        super().__init__(f"{tier} tier replied {code}: {message}" + (" (retryable)" if retryable else ""))


class RemoteUserError(RemoteError, UserError):
    """A peer refused a request for a reason the user can fix (its code says so)."""


class RemoteFailure(RemoteError, Failure):
    """A peer failed to serve a request (a crash, a lost dependency, a timeout)."""


def remote_error(
    tier: str, code: str, message: str, retryable: bool = False, retry_after_s: float = 0.0
) -> RemoteError:
    """The :class:`RemoteError` for an ErrorReply: a user error or a failure, by its code."""
    entry = WIRE_CODES.get(code, WIRE_CODES["internal"])
    kind = RemoteUserError if entry.user_error else RemoteFailure
    return kind(tier, code, message, retryable, retry_after_s)


class TransportClosed(Failure, ConnectionError):
    """The transport was used after close() or lost its server for good."""

    def __init__(self, what: str = "transport") -> None:
        super().__init__(f"{what} is closed")


class NatsServerError(Failure, RuntimeError):
    """The embedded nats-server could not be found, started or reached."""


class WorkerDraining(Failure):
    """A request reached a worker that is stopping: it was not started; another worker can take it."""

    code = "unavailable"
    retryable = True

    def __init__(self, tier: str, worker_id: str, kind: str) -> None:
        self.tier = tier
        self.worker_id = worker_id
        self.kind = kind
        super().__init__(
            f"{tier} worker {worker_id} is draining (stopping): {kind} not started; send it to another worker"
        )


# --- data plane -----------------------------------------------------------------------------


class TensorError(Failure):
    """Marker base for tensor-plane errors."""


class ChecksumMismatch(TensorError, ValueError):
    """A tensor's bytes do not match the checksum sent with them."""

    def __init__(self, name: str, expected: int, actual: int) -> None:
        self.name = name
        self.expected = expected
        self.actual = actual
        super().__init__(f"tensor {name!r}: checksum {actual:#010x} does not match sent {expected:#010x}")


class ShapeMismatch(TensorError, ValueError):
    """A tensor's byte count does not fit its shape and dtype."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, nbytes: int, expected: int) -> None:
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self.nbytes = nbytes
        self.expected = expected
        super().__init__(
            f"tensor {name!r}: {nbytes} bytes do not fit shape {list(shape)} of {dtype} "
            f"({expected} bytes expected)"
        )


class UnknownDtype(TensorError, ValueError):
    """A dtype name that the safetensors layout does not define."""

    def __init__(self, dtype: str, name: str = "") -> None:
        self.dtype = dtype
        self.name = name
        where = f"tensor {name!r}: " if name else ""
        super().__init__(f"{where}unknown dtype {dtype!r}")


class UnknownKey(TensorError, KeyError):
    """No entry under that key in a TensorStore (never stored, expired or deleted)."""

    def __init__(self, key: str, address: str = "") -> None:
        self.key = key
        self.address = address
        where = f" at {address}" if address else ""
        super().__init__(f"no tensors stored under key {key!r}{where} (never put, expired or deleted)")

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence readable
        return str(self.args[0])


class StreamTruncated(TensorError, ConnectionError):
    """A tensor stream ended before its end marker, or a tensor before its last byte."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        self.detail = detail
        super().__init__(f"tensor stream for key {key!r} cut off: {detail}")


class StoreFull(TensorError, MemoryError):
    """A put would take the TensorStore over its byte capacity."""

    def __init__(self, requested: int, used: int, capacity: int) -> None:
        self.requested = requested
        self.used = used
        self.capacity = capacity
        super().__init__(
            f"TensorStore full: {requested} more bytes asked, {used} of {capacity} in use; "
            "delete consumed keys, shorten the TTL or raise the capacity"
        )


class MalformedChunk(TensorError, ValueError):
    """A tensor chunk that cannot be decoded or breaks the stream's rules (order, key, fields)."""

    def __init__(self, detail: str, key: str = "", name: str = "") -> None:
        self.detail = detail
        self.key = key
        self.name = name
        where = "".join([f"key {key!r} " if key else "", f"tensor {name!r} " if name else ""])
        super().__init__(f"malformed tensor chunk{': ' + where.strip() if where else ''}: {detail}")


class UnknownTensor(TensorError, KeyError):
    """A key is stored but holds no tensor of the requested name."""

    def __init__(self, key: str, name: str, available: tuple[str, ...] = ()) -> None:
        self.key = key
        self.name = name
        self.available = tuple(available)
        shown = ", ".join(repr(n) for n in self.available[:8]) + (" ..." if len(self.available) > 8 else "")
        super().__init__(f"key {key!r} holds no tensor named {name!r} (it holds: {shown or 'nothing'})")

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence readable
        return str(self.args[0])


class TensorStoreUnavailable(TensorError, ConnectionError):
    """The TensorStore server at an address cannot be reached (down, wrong address, shut down)."""

    def __init__(self, address: str, detail: str = "") -> None:
        self.address = address
        self.detail = detail
        super().__init__(f"TensorStore at {address} is unreachable" + (f": {detail}" if detail else ""))


class TensorAccessDenied(TensorError, PermissionError):
    """A TensorStore call without the capability (or store secret) it needs: nothing was read or changed."""

    code = "forbidden"

    def __init__(self, key: str, address: str = "", reason: str = "") -> None:
        self.key = key
        self.address = address
        self.reason = reason
        where = f" at {address}" if address else ""
        super().__init__(
            f"TensorStore{where} refused access to key {key!r}: {reason or 'no valid capability'} "
            "(read through the TensorRef the store handed out; writes need the store's secret)"
        )


class KeyExists(TensorError, FileExistsError):
    """A put under a key the TensorStore already holds (stores never overwrite)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"TensorStore already holds key {key!r}; a put never overwrites (delete it first)")


class TensorStoreBusy(TensorError, ConnectionError):
    """A TensorStore is at its cap of concurrent RPCs; retry later."""

    retryable = True

    def __init__(self, address: str, detail: str = "") -> None:
        self.address = address
        self.detail = detail
        suffix = f": {detail}" if detail else ""
        super().__init__(f"TensorStore at {address} is busy (too many concurrent calls){suffix}")


class TensorStoreTimeout(TensorError, TimeoutError):
    """A TensorStore call ran past its deadline."""

    def __init__(self, address: str, method: str, timeout: float) -> None:
        self.address = address
        self.method = method
        self.timeout = timeout
        super().__init__(f"TensorStore {method} at {address} did not finish within its {timeout:g}s deadline")


class WrongMessageKind(UserError, ValueError):
    """A well-formed message of a kind this subject does not take (``bad_request``)."""

    def __init__(self, where: str, kind: str) -> None:
        self.where = where
        self.kind = kind
        super().__init__(f"{where} does not take {kind!r} messages")


class BatchContractError(UserError, ValueError):
    """A rollout batch breaks the tensor contract (a field missing, of the wrong dtype or shape)."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"rollout batch field {field!r}: {reason}")


class JobIdReused(UserError, ValueError):
    """A request reuses the ``job_id`` of an earlier, different request (an idempotency key names one job)."""

    code = "bad_request"

    def __init__(self, kind: str, job_id: str, fields: list[str]) -> None:
        self.kind = kind
        self.job_id = job_id
        self.fields = list(fields)
        super().__init__(
            f"{kind} job_id {job_id!r} was first used for another request (it differs in "
            f"{', '.join(self.fields) or 'nothing visible'}); a retry repeats its request, a new job "
            "takes a new id"
        )


class HubModelNotFound(UserError, FileNotFoundError):
    """A Hugging Face Hub model id that could not be made a local folder (not cached, offline, or the
    download failed); ``reason`` says which and what to do."""

    def __init__(self, repo_id: str, reason: str) -> None:
        self.repo_id = repo_id
        self.reason = reason
        super().__init__(f"Hub model {repo_id!r}: {reason}")


_BY_KIND: tuple[tuple[type[BaseException], str], ...] = (
    (ProtocolMismatch, "protocol_mismatch"),
    (MessageDecodeError, "bad_message"),
    (MessageTooLarge, "too_large"),
    (TimeoutError, "timeout"),
    (ConnectionError, "unavailable"),
    (UserError, "bad_request"),
)
