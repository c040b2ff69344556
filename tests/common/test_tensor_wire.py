"""tensor_wire: the hand-written TensorChunk codec stays byte-compatible with the generated protobuf code."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.common.errors import MalformedChunk
from rlfleet.common.tensors._gen import tensors_pb2
from rlfleet.common.tensors.codec import (
    FIELDS,
    Chunk,
    chunk_from_proto,
    chunk_to_proto,
    decode_chunk,
    encode_chunk,
)

_text = st.text(max_size=12)
_chunks = st.builds(
    Chunk,
    key=_text,
    name=_text,
    dtype=_text,
    shape=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=4).map(tuple),
    offset=st.integers(0, (1 << 64) - 1),
    total_bytes=st.integers(0, (1 << 64) - 1),
    crc32=st.none() | st.integers(0, (1 << 32) - 1),
    data=st.binary(max_size=64),
    end_of_stream=st.booleans(),
    tensor_count=st.integers(0, (1 << 32) - 1),
)


def _plain(chunk: Chunk) -> Chunk:
    """The chunk with its payload as bytes, for equality checks."""
    return Chunk(
        chunk.key,
        chunk.name,
        chunk.dtype,
        tuple(chunk.shape),
        chunk.offset,
        chunk.total_bytes,
        chunk.crc32,
        bytes(chunk.data),
        chunk.end_of_stream,
        chunk.tensor_count,
    )


def test_field_numbers_match_the_proto() -> None:
    descriptor = tensors_pb2.TensorChunk.DESCRIPTOR
    assert {f.name: f.number for f in descriptor.fields} == FIELDS


@settings(max_examples=300, deadline=None)
@given(_chunks)
def test_protobuf_reads_what_we_write(chunk: Chunk) -> None:
    message = tensors_pb2.TensorChunk.FromString(encode_chunk(chunk))
    assert _plain(chunk_from_proto(message)) == _plain(chunk)


@settings(max_examples=300, deadline=None)
@given(_chunks)
def test_we_read_what_protobuf_writes(chunk: Chunk) -> None:
    encoded = chunk_to_proto(chunk).SerializeToString()
    assert _plain(decode_chunk(encoded)) == _plain(chunk)
    assert encode_chunk(chunk) == encoded  # same canonical order: field numbers ascending


def test_decoded_payload_is_a_view_of_the_message() -> None:
    encoded = encode_chunk(Chunk("k", "t", "U8", (3,), 0, 3, 7, b"abc"))
    decoded = decode_chunk(encoded)
    assert isinstance(decoded.data, memoryview)
    assert decoded.data.obj is encoded


def test_unpacked_shape_and_unknown_fields_are_accepted() -> None:
    # shape as three separate varint fields (unpacked), then an unknown field 20 (varint) and 21 (bytes)
    raw = b"\x0a\x01k" + b"\x20\x02\x20\x03\x20\x04" + b"\xa0\x01\x05" + b"\xaa\x01\x02hi" + b"\x7a\x02xy"
    chunk = decode_chunk(raw)
    assert (chunk.key, chunk.shape, bytes(chunk.data)) == ("k", (2, 3, 4), b"xy")
    fixed = b"\x0a\x01k" + b"\xa9\x01" + b"\x00" * 8 + b"\xad\x01" + b"\x00" * 4  # fields 21/I64 and 21/I32
    assert decode_chunk(fixed).key == "k"


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"\x0a", "truncated varint"),
        (b"\x0a\x05ab", "claims 5 bytes"),
        (b"\x28" + b"\xff" * 11, "longer than 10 bytes"),
        (b"\x00\x01", "field number 0"),
        (b"\x0b", "unsupported wire type 3"),
        (b"\x0a\x02\xff\xfe", "not valid UTF-8"),
        (b"\x08\x01", "wrong wire type"),
        (b"\xa9\x01\x00", "truncated"),
    ],
)
def test_malformed_bytes_raise_malformed_chunk(raw: bytes, match: str) -> None:
    with pytest.raises(MalformedChunk, match=match):
        decode_chunk(raw)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=96))
def test_arbitrary_bytes_decode_or_raise_malformed_chunk(raw: bytes) -> None:
    try:
        chunk = decode_chunk(raw)
    except MalformedChunk:
        return
    assert isinstance(chunk, Chunk)
