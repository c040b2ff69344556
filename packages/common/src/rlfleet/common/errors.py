"""Every error rlfleet-common raises, in one place.

Each error subclasses a builtin so callers can catch broadly (``ValueError``) or precisely
(``ChecksumMismatch``). Errors keep their fields and build their own message. User mistakes
(bad config, bad input) are kept apart from runtime failures (timeouts, lost peers).
"""

from __future__ import annotations


class RlfleetError(Exception):
    """Marker base for every rlfleet error; never raised on its own."""


# --- user mistakes --------------------------------------------------------------------------


class ConfigError(RlfleetError, ValueError):
    """A config file or override is malformed; names the field path and the bad value."""

    def __init__(self, path: str, value: object, reason: str) -> None:
        self.path = path
        self.value = value
        self.reason = reason
        super().__init__(f"config field {path!r} = {value!r}: {reason}")


# --- control plane --------------------------------------------------------------------------


class ProtocolMismatch(RlfleetError, ValueError):
    """A message speaks another MAJOR version of the wire schema."""

    def __init__(self, ours: str, theirs: str) -> None:
        self.ours = ours
        self.theirs = theirs
        super().__init__(
            f"wire protocol mismatch: this process speaks {ours}, the message is {theirs} "
            "(MAJOR versions must match; upgrade the older side)"
        )


class MessageDecodeError(RlfleetError, ValueError):
    """Bytes that arrived are not a valid control message."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"cannot decode control message: {reason}")


class MessageTooLarge(RlfleetError, ValueError):
    """A message (or chunk) is over the size limit of its transport; ``hint`` says what to do instead."""

    def __init__(self, size: int, limit: int, what: str = "message", hint: str = "") -> None:
        self.size = size
        self.limit = limit
        self.what = what
        self.hint = hint
        advice = hint or "send bulk data over the gRPC tensor plane and pass a TensorRef instead"
        super().__init__(f"{what} of {size} bytes is over the {limit}-byte limit; {advice}")


class RequestTimeout(RlfleetError, TimeoutError):
    """No reply came on a subject in time."""

    def __init__(self, subject: str, tier: str, timeout: float) -> None:
        self.subject = subject
        self.tier = tier
        self.timeout = timeout
        super().__init__(
            f"no reply from the {tier} tier on {subject!r} within {timeout:g}s "
            "(is a worker of that tier running and connected?)"
        )


class NoResponders(RlfleetError, ConnectionError):
    """Nobody listens on a subject."""

    def __init__(self, subject: str, tier: str) -> None:
        self.subject = subject
        self.tier = tier
        super().__init__(f"no {tier} worker is subscribed to {subject!r}")


class RemoteError(RlfleetError, RuntimeError):
    """A peer answered with an ErrorReply."""

    def __init__(self, tier: str, code: str, message: str, retryable: bool = False) -> None:
        self.tier = tier
        self.code = code
        self.remote_message = message
        self.retryable = retryable
        super().__init__(f"{tier} tier replied {code}: {message}" + (" (retryable)" if retryable else ""))


class TransportClosed(RlfleetError, ConnectionError):
    """The transport was used after close() or lost its server for good."""

    def __init__(self, what: str = "transport") -> None:
        super().__init__(f"{what} is closed")


class NatsServerError(RlfleetError, RuntimeError):
    """The embedded nats-server could not be found, started or reached."""


# --- data plane -----------------------------------------------------------------------------


class TensorError(RlfleetError):
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


class BatchContractError(RlfleetError, ValueError):
    """A rollout batch breaks the tensor contract (a field missing, of the wrong dtype or shape)."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"rollout batch field {field!r}: {reason}")
