"""``TensorChunk`` (``proto/tensors.proto``) to and from protobuf bytes, without copying the payload twice.

Why not the generated class on the hot path: building a ``TensorChunk`` needs the payload as
``bytes`` (one copy out of the tensor), ``SerializeToString`` copies it again, and on the way in
reading ``.data`` copies it once more before it reaches the tensor. Here :func:`encode_chunk` joins
a small header with the tensor's memory in one copy, and :func:`decode_chunk` hands the payload on
as a memoryview of the received message. benchmarks/README.md has the numbers.

The bytes are plain protobuf: any protobuf library reads what :func:`encode_chunk` writes, and
:func:`decode_chunk` reads any valid encoding of a ``TensorChunk`` (any field order, packed or
unpacked ``shape``, unknown fields skipped). tests/common/test_tensor_wire.py checks both
against the generated ``tensors_pb2``. Malformed bytes raise :class:`MalformedChunk`, nothing else.
"""

from __future__ import annotations

import logging

from rlfleet.common.errors import MalformedChunk
from rlfleet.common.tensors._gen import tensors_pb2
from rlfleet.common.tensors.codec import Chunk

logger = logging.getLogger(__name__)

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
# Field numbers of TensorChunk; a test checks them against the generated descriptor.
FIELDS = {
    "key": 1,
    "name": 2,
    "dtype": 3,
    "shape": 4,
    "offset": 5,
    "total_bytes": 6,
    "crc32": 7,
    "end_of_stream": 8,
    "tensor_count": 9,
    "data": 15,
}
_U64 = (1 << 64) - 1


def _varint(value: int) -> bytes:
    """Protobuf base-128 varint of an unsigned 64-bit value (negatives as two's complement)."""
    value &= _U64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


_TAG_KEY, _TAG_NAME, _TAG_DTYPE, _TAG_SHAPE, _TAG_DATA = (
    _tag(FIELDS[f], _LEN) for f in ("key", "name", "dtype", "shape", "data")
)
_TAG_OFFSET, _TAG_TOTAL, _TAG_CRC, _TAG_END, _TAG_COUNT = (
    _tag(FIELDS[f], _VARINT) for f in ("offset", "total_bytes", "crc32", "end_of_stream", "tensor_count")
)
# Decoding tables: field number -> attribute, per kind of value.
_STRINGS = {FIELDS[f]: f for f in ("key", "name", "dtype")}
_U32 = (1 << 32) - 1
_UINTS = {
    FIELDS[f]: (f, mask)
    for f, mask in (("offset", _U64), ("total_bytes", _U64), ("crc32", _U32), ("tensor_count", _U32))
}


def encode_chunk(chunk: Chunk) -> bytes:
    """The protobuf encoding of ``chunk`` as a ``TensorChunk``; the payload is copied once."""
    parts: list[bytes | memoryview] = []
    for tag, text in ((_TAG_KEY, chunk.key), (_TAG_NAME, chunk.name), (_TAG_DTYPE, chunk.dtype)):
        if text:
            raw = text.encode()
            parts += (tag, _varint(len(raw)), raw)
    if chunk.shape:
        packed = b"".join(_varint(d) for d in chunk.shape)
        parts += (_TAG_SHAPE, _varint(len(packed)), packed)
    for tag, number in ((_TAG_OFFSET, chunk.offset), (_TAG_TOTAL, chunk.total_bytes)):
        if number:
            parts += (tag, _varint(number))
    if chunk.crc32 is not None:
        parts += (_TAG_CRC, _varint(chunk.crc32))
    if chunk.end_of_stream:
        parts += (_TAG_END, b"\x01")
    if chunk.tensor_count:
        parts += (_TAG_COUNT, _varint(chunk.tensor_count))
    if len(chunk.data):
        parts += (_TAG_DATA, _varint(len(chunk.data)), chunk.data)
    return b"".join(parts)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise MalformedChunk("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result & _U64, pos
        shift += 7
        if shift >= 70:
            raise MalformedChunk("varint longer than 10 bytes")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(raw: memoryview, field: str) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError:
        raise MalformedChunk(f"field {field!r} is not valid UTF-8") from None


def _packed_shape(raw: memoryview) -> list[int]:
    dims: list[int] = []
    pos = 0
    while pos < len(raw):
        value, pos = _read_varint(raw, pos)
        dims.append(_signed(value))
    return dims


def _fields(buf: memoryview) -> list[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of every field, in order; payloads stay views of ``buf``."""
    out: list[tuple[int, int, int | memoryview]] = []
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        field, wire_type = tag >> 3, tag & 7
        if field == 0:
            raise MalformedChunk("field number 0")
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
            out.append((field, wire_type, value))
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos)
            if length > len(buf) - pos:
                raise MalformedChunk(f"field {field} claims {length} bytes, {len(buf) - pos} remain")
            out.append((field, wire_type, buf[pos : pos + length]))
            pos += length
        elif wire_type in (_I64, _I32):
            width = 8 if wire_type == _I64 else 4
            if width > len(buf) - pos:
                raise MalformedChunk(f"field {field} truncated")
            out.append((field, wire_type, int.from_bytes(buf[pos : pos + width], "little")))
            pos += width
        else:
            raise MalformedChunk(f"field {field} has unsupported wire type {wire_type}")
    return out


def decode_chunk(message: bytes | bytearray | memoryview) -> Chunk:
    """The :class:`Chunk` a ``TensorChunk`` encoding holds; ``data`` is a view of ``message``."""
    chunk = Chunk(key="")
    shape: list[int] = []
    for field, wire_type, value in _fields(memoryview(message).cast("B")):
        if field == FIELDS["shape"] and wire_type in (_LEN, _VARINT):
            if isinstance(value, memoryview):
                shape.extend(_packed_shape(value))
            else:
                shape.append(_signed(value))
        elif field == FIELDS["data"] and isinstance(value, memoryview):
            chunk.data = value
        elif field in _STRINGS and isinstance(value, memoryview):
            setattr(chunk, _STRINGS[field], _text(value, _STRINGS[field]))
        elif field in _UINTS and wire_type == _VARINT:
            attr, mask = _UINTS[field]
            setattr(chunk, attr, value & mask)  # type: ignore[operator]
        elif field == FIELDS["end_of_stream"] and wire_type == _VARINT:
            chunk.end_of_stream = bool(value)
        elif field in _KNOWN:
            raise MalformedChunk(f"field {field} has the wrong wire type {wire_type}")
        # else: a field from a newer schema; skip it, as protobuf does
    chunk.shape = tuple(shape)
    return chunk


_KNOWN = frozenset(FIELDS.values())


def chunk_to_proto(chunk: Chunk) -> tensors_pb2.TensorChunk:
    """The generated message of a chunk (copies the payload; for tests and tools, not the hot path)."""
    message = tensors_pb2.TensorChunk(
        key=chunk.key,
        name=chunk.name,
        dtype=chunk.dtype,
        shape=list(chunk.shape),
        offset=chunk.offset,
        total_bytes=chunk.total_bytes,
        end_of_stream=chunk.end_of_stream,
        tensor_count=chunk.tensor_count,
        data=bytes(chunk.data),
    )
    if chunk.crc32 is not None:
        message.crc32 = chunk.crc32
    return message


def chunk_from_proto(message: tensors_pb2.TensorChunk) -> Chunk:
    """The chunk a generated message holds."""
    return Chunk(
        key=message.key,
        name=message.name,
        dtype=message.dtype,
        shape=tuple(message.shape),
        offset=message.offset,
        total_bytes=message.total_bytes,
        crc32=message.crc32 if message.HasField("crc32") else None,
        data=message.data,
        end_of_stream=message.end_of_stream,
        tensor_count=message.tensor_count,
    )
