"""What both ends of the TensorStore gRPC service share: method paths, channel options, error mapping.

This is the one place where tensor-plane errors and gRPC status codes meet. The server aborts an
RPC with :func:`abort_rpc`: a status code for generic gRPC tooling, plus two trailing-metadata
entries, the error's wire code and its constructor fields as JSON. :func:`error_from_rpc` on the
client rebuilds the very same exception class with the same fields, so
``except ChecksumMismatch`` works across the network.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import NoReturn

import grpc

from rlfleet.common.errors import (
    ChecksumMismatch,
    KeyExists,
    MalformedChunk,
    MessageTooLarge,
    RemoteError,
    RlfleetError,
    ShapeMismatch,
    StoreFull,
    StreamTruncated,
    TensorAccessDenied,
    TensorStoreBusy,
    TensorStoreTimeout,
    TensorStoreUnavailable,
    UnknownDtype,
    UnknownKey,
    UnknownTensor,
)
from rlfleet.common.tensors._gen import tensors_pb2
from rlfleet.common.tensors.codec import CHUNK_HINT

logger = logging.getLogger(__name__)

SERVICE = tensors_pb2.DESCRIPTOR.services_by_name["TensorStore"].full_name  # rlfleet.tensors.v1.TensorStore
# Room for a chunk's header fields (key, name, shape...) on top of its payload.
HEADER_SLACK_BYTES = 64 << 10

ERROR_CODE_KEY = "rlfleet-error"
ERROR_FIELDS_KEY = "rlfleet-error-fields"

# wire code -> (exception class, gRPC status). Each class keeps its constructor arguments as
# attributes of the same names, which is what lets the client rebuild it.
ERRORS: dict[str, tuple[type[RlfleetError], grpc.StatusCode]] = {
    "checksum_mismatch": (ChecksumMismatch, grpc.StatusCode.DATA_LOSS),
    "stream_truncated": (StreamTruncated, grpc.StatusCode.DATA_LOSS),
    "shape_mismatch": (ShapeMismatch, grpc.StatusCode.INVALID_ARGUMENT),
    "unknown_dtype": (UnknownDtype, grpc.StatusCode.INVALID_ARGUMENT),
    "malformed_chunk": (MalformedChunk, grpc.StatusCode.INVALID_ARGUMENT),
    "message_too_large": (MessageTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    "store_full": (StoreFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    "unknown_key": (UnknownKey, grpc.StatusCode.NOT_FOUND),
    "unknown_tensor": (UnknownTensor, grpc.StatusCode.NOT_FOUND),
    "access_denied": (TensorAccessDenied, grpc.StatusCode.PERMISSION_DENIED),
    "key_exists": (KeyExists, grpc.StatusCode.ALREADY_EXISTS),
}
_CODES = {cls: code for code, (cls, _) in ERRORS.items()}
_FIELDS: dict[type[RlfleetError], tuple[str, ...]] = {
    ChecksumMismatch: ("name", "expected", "actual"),
    StreamTruncated: ("key", "detail"),
    ShapeMismatch: ("name", "shape", "dtype", "nbytes", "expected"),
    UnknownDtype: ("dtype", "name"),
    MalformedChunk: ("detail", "key", "name"),
    MessageTooLarge: ("size", "limit", "what", "hint"),
    StoreFull: ("requested", "used", "capacity"),
    UnknownKey: ("key", "address"),
    UnknownTensor: ("key", "name", "available"),
    TensorAccessDenied: ("key", "address", "reason"),
    KeyExists: ("key",),
}
_MAX_TEXT = 512
_MAX_ITEMS = 64
_CORE_TOO_LARGE = re.compile(r"larger than max \((\d+) vs\. (\d+)\)")
_CORE_BUSY = "Concurrent RPC limit exceeded"  # grpc's refusal past the server's maximum_concurrent_rpcs


def method(name: str) -> str:
    """The full gRPC path of a TensorStore method, e.g. ``/rlfleet.tensors.v1.TensorStore/Put``."""
    return f"/{SERVICE}/{name}"


def check_sizes(chunk_bytes: int, max_message_bytes: int) -> None:
    """``ValueError`` unless ``0 < chunk_bytes <= max_message_bytes``."""
    if not 0 < chunk_bytes <= max_message_bytes:
        raise ValueError(
            f"chunk_bytes ({chunk_bytes}) must be positive and at most "
            f"max_message_bytes ({max_message_bytes})"
        )


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options for both the server and the client channel: message limits and stream tuning."""
    limit = max_message_bytes + HEADER_SLACK_BYTES
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
    ]


def _clip(value: object) -> object:
    """Keep metadata small: long strings and lists are cut (metadata is limited to a few KiB)."""
    if isinstance(value, str):
        return value[:_MAX_TEXT]
    if isinstance(value, list | tuple):
        return [_clip(v) for v in value[:_MAX_ITEMS]]
    return value


def error_metadata(exc: RlfleetError) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]:
    """The status code and trailing metadata that carry ``exc`` to the client."""
    cls = type(exc)
    code = _CODES.get(cls)
    if code is None:
        raise TypeError(f"{cls.__name__} has no wire code in rlfleet.common.tensors.rpc.ERRORS")
    fields = {f: _clip(getattr(exc, f)) for f in _FIELDS[cls]}
    return ERRORS[code][1], ((ERROR_CODE_KEY, code), (ERROR_FIELDS_KEY, json.dumps(fields)))


async def abort_rpc(context: grpc.aio.ServicerContext, exc: RlfleetError, *, early: bool = False) -> NoReturn:
    """End the RPC with ``exc`` (a class of :data:`ERRORS`), for the client to raise again.

    ``early`` also sends the error as initial metadata, for RPCs the client may still be writing
    to (Put): when a call ends while the client is sending, grpc.aio on the client replaces the
    server's status and trailers with "INTERNAL: Internal error from Core", but the initial
    metadata still arrives, and :func:`error_from_rpc` looks there too.
    """
    status, metadata = error_metadata(exc)
    if early:
        await context.send_initial_metadata(metadata)
    await context.abort(status, str(exc)[: 4 * _MAX_TEXT], trailing_metadata=metadata)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def _rebuild(code: str, fields_json: str) -> RlfleetError | None:
    cls = ERRORS[code][0]
    try:
        fields = json.loads(fields_json)
        if not isinstance(fields, dict):
            return None
        if "shape" in fields and isinstance(fields["shape"], list):
            fields["shape"] = tuple(fields["shape"])
        if "available" in fields and isinstance(fields["available"], list):
            fields["available"] = tuple(fields["available"])
        return cls(**fields)
    except (json.JSONDecodeError, TypeError, ValueError):
        return None


def error_from_rpc(
    err: grpc.RpcError,
    address: str,
    initial_metadata: Sequence[tuple[str, str | bytes]] = (),
    *,
    rpc: str = "",
    timeout: float = 0.0,
) -> Exception:
    """The exception a failed TensorStore RPC stands for (to ``raise ... from None``).

    Our error travels in the trailing metadata, or in ``initial_metadata`` (see :func:`abort_rpc`).
    Our own errors come back as their class; an unreachable server as
    :class:`TensorStoreUnavailable`; gRPC's own message-size refusal as :class:`MessageTooLarge`;
    a call past its deadline (``rpc``, ``timeout``) as :class:`TensorStoreTimeout`; a server at
    its cap of concurrent calls as :class:`TensorStoreBusy`; a refusal without our metadata
    (PERMISSION_DENIED, UNAUTHENTICATED) as :class:`TensorAccessDenied`; anything else as
    :class:`RemoteError` with the status name as its code.
    """
    code_fn = getattr(err, "code", None)
    status = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details_fn = getattr(err, "details", None)
    details = (details_fn() if callable(details_fn) else None) or ""
    metadata_fn = getattr(err, "trailing_metadata", None)
    metadata = dict(metadata_fn() or ()) if callable(metadata_fn) else {}
    if ERROR_CODE_KEY not in metadata:
        metadata = dict(initial_metadata)
    code = metadata.get(ERROR_CODE_KEY)
    if isinstance(code, str) and code in ERRORS:
        rebuilt = _rebuild(code, str(metadata.get(ERROR_FIELDS_KEY, "{}")))
        if isinstance(rebuilt, UnknownKey) and not rebuilt.address:
            rebuilt = UnknownKey(rebuilt.key, address)
        if isinstance(rebuilt, TensorAccessDenied) and not rebuilt.address:
            rebuilt = TensorAccessDenied(rebuilt.key, address, rebuilt.reason)
        if rebuilt is not None:
            return rebuilt
    if status == grpc.StatusCode.UNAVAILABLE:
        return TensorStoreUnavailable(address, details)
    if status == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TensorStoreTimeout(address, rpc or "call", timeout)
    if status in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        return TensorAccessDenied("", address, details[:_MAX_TEXT])
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED and _CORE_BUSY in details:
        return TensorStoreBusy(address, details)
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED:
        match = _CORE_TOO_LARGE.search(details)
        if match:
            return MessageTooLarge(int(match.group(1)), int(match.group(2)), "gRPC message", CHUNK_HINT)
    return RemoteError("tensorstore", status.name, details)
