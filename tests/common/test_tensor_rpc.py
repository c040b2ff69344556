"""tensors.rpc: every tensor-plane error survives the trip through gRPC status and metadata.

The samples are one realistic error of each class the wire table maps (a test checks that they
cover it); the other tests are behaviours of the mapping: gRPC's own refusals get named errors.
"""

from __future__ import annotations

import grpc
import pytest

from rlfleet.common import errors
from rlfleet.common.tensors.rpc import (
    ERRORS,
    channel_options,
    check_sizes,
    error_from_rpc,
    error_metadata,
    method,
)


class FakeRpcError(grpc.RpcError):
    """What a failed aio call looks like to the client."""

    def __init__(
        self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self._code = code
        self._details = details
        self._metadata = metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


SAMPLES: list[errors.RlfleetError] = [
    errors.ChecksumMismatch("w", 0x1234, 0x5678),
    errors.StreamTruncated("k", "no end-of-stream marker"),
    errors.ShapeMismatch("w", (2, 3), "F32", 20, 24),
    errors.UnknownDtype("F7", "w"),
    errors.MalformedChunk("key changed", "k", "w"),
    errors.MessageTooLarge(100, 50, "tensor chunk"),
    errors.StoreFull(10, 90, 95),
    errors.UnknownKey("k", "host:1"),
    errors.UnknownTensor("k", "zz", ("a", "b")),
    errors.TensorAccessDenied("k", "host:1", "no valid capability for this key"),
    errors.KeyExists("k"),
]


def test_every_mapped_error_has_a_sample() -> None:
    assert {type(e) for e in SAMPLES} == {cls for cls, _ in ERRORS.values()}


@pytest.mark.parametrize("exc", SAMPLES, ids=lambda e: type(e).__name__)
def test_errors_round_trip_with_their_fields(exc: errors.RlfleetError) -> None:
    status, metadata = error_metadata(exc)
    rebuilt = error_from_rpc(FakeRpcError(status, str(exc), metadata), "host:1")
    assert type(rebuilt) is type(exc)
    assert str(rebuilt) == str(exc)
    assert vars(rebuilt) == vars(exc)


def test_error_found_in_initial_metadata_when_the_status_was_replaced() -> None:
    _, metadata = error_metadata(errors.StoreFull(10, 90, 95))
    replaced = FakeRpcError(grpc.StatusCode.INTERNAL, "Internal error from Core")
    rebuilt = error_from_rpc(replaced, "h:1", metadata)
    assert isinstance(rebuilt, errors.StoreFull) and rebuilt.capacity == 95
    assert isinstance(error_from_rpc(replaced, "h:1"), errors.RemoteError)


def test_unknown_key_gets_the_client_address() -> None:
    status, metadata = error_metadata(errors.UnknownKey("k"))
    rebuilt = error_from_rpc(FakeRpcError(status, "", metadata), "store:7")
    assert isinstance(rebuilt, errors.UnknownKey) and rebuilt.address == "store:7"


def test_long_fields_are_clipped_to_fit_metadata() -> None:
    _, metadata = error_metadata(errors.UnknownTensor("k" * 5000, "n", tuple(str(i) for i in range(1000))))
    assert sum(len(v) for _, v in metadata) < 8192


def test_status_without_our_metadata() -> None:
    unavailable = error_from_rpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"), "h:1")
    assert isinstance(unavailable, errors.TensorStoreUnavailable) and unavailable.address == "h:1"
    too_large = error_from_rpc(
        FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (200 vs. 100)"),
        "h:1",
    )
    assert isinstance(too_large, errors.MessageTooLarge) and (too_large.size, too_large.limit) == (200, 100)
    other = error_from_rpc(FakeRpcError(grpc.StatusCode.INTERNAL, "boom"), "h:1")
    assert isinstance(other, errors.RemoteError) and other.code == "INTERNAL"
    garbled = (("rlfleet-error", "store_full"), ("rlfleet-error-fields", "{not json"))
    unreadable = error_from_rpc(FakeRpcError(grpc.StatusCode.UNKNOWN, "x", garbled), "h:1")
    assert isinstance(unreadable, errors.RemoteError)


def test_helpers() -> None:
    assert method("Put") == "/rlfleet.tensors.v1.TensorStore/Put"
    options = dict(channel_options(1 << 20))
    assert options["grpc.max_receive_message_length"] > 1 << 20
    assert options["grpc.max_send_message_length"] == options["grpc.max_receive_message_length"]
    check_sizes(10, 10)
    with pytest.raises(ValueError, match="at most"):
        check_sizes(11, 10)
    with pytest.raises(ValueError):
        check_sizes(0, 10)
    with pytest.raises(TypeError, match="no wire code"):
        error_metadata(errors.RemoteError("t", "c", "m"))


def test_refusals_without_our_metadata_get_named_errors() -> None:
    timeout = error_from_rpc(
        FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), "h:1", rpc="Get", timeout=2.5
    )
    assert isinstance(timeout, errors.TensorStoreTimeout)
    assert "Get at h:1" in str(timeout) and "2.5s" in str(timeout)
    busy = error_from_rpc(
        FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!"), "h:1"
    )
    assert isinstance(busy, errors.TensorStoreBusy) and busy.retryable
    denied = error_from_rpc(FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "no"), "h:1")
    assert isinstance(denied, errors.TensorAccessDenied) and denied.address == "h:1"
