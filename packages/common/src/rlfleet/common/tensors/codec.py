"""Tensors as safetensors-layout bytes, and a dict of tensors as a validated stream of chunks.

The layout is safetensors' raw one: a tensor's elements, contiguous, row-major, little-endian,
named by safetensors' dtype names (``BF16``, ``F32``, ...). A dict of tensors travels as
:class:`Chunk` s: each tensor's bytes cut in order into pieces of at most ``chunk_bytes``, the
tensor's crc32 on its last piece, then one end-of-stream chunk that counts the tensors.
:func:`split_tensors` makes that stream and :class:`ChunkAssembler` (or :func:`assemble_tensors`)
checks every field while rebuilding the tensors, raising the tensor-plane errors of
:mod:`rlfleet.common.errors` and nothing else. A big received tensor lands on huge pages
(:func:`empty_bytes`).

On the wire each chunk is a ``TensorChunk`` (``proto/tensors.proto``) as protobuf bytes
(:func:`encode_chunk`, :func:`decode_chunk`, the last section), without the generated class on the
hot path: building a ``TensorChunk`` needs the payload as ``bytes`` (one copy out of the tensor),
``SerializeToString`` copies it again, and on the way in reading ``.data`` copies it once more.
Here :func:`encode_chunk` joins a small header with the tensor's memory in one copy, and
:func:`decode_chunk` hands the payload on as a memoryview of the received message
(benchmarks/README.md has the numbers). The bytes are plain protobuf: any protobuf library reads
what :func:`encode_chunk` writes, and :func:`decode_chunk` reads any valid encoding of a
``TensorChunk`` (any field order, packed or unpacked ``shape``, unknown fields skipped);
tests/common/test_tensor_wire.py checks both against the generated ``tensors_pb2``. Malformed
bytes raise :class:`MalformedChunk`, nothing else.

**torch or numpy.** Where torch is installed, tensors are torch tensors (every safetensors dtype,
zero-copy views). rlfleet-common installs without torch too (its ``torch`` extra brings it): the
reward server only reads texts and a few numbers. There, and wherever ``arrays="numpy"`` is asked
for, received tensors are numpy arrays (:data:`NUMPY_DTYPES`: every dtype but ``BF16`` and the fp8
ones, which numpy lacks and which are refused by name), and numpy arrays may be sent and stored
beside torch tensors: the bytes on the wire are the same.

Nothing here pickles; nothing here touches the network.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from zlib_ng.zlib_ng import crc32 as _crc32

from rlfleet.common.errors import (
    ChecksumMismatch,
    MalformedChunk,
    MessageTooLarge,
    ShapeMismatch,
    StreamTruncated,
    UnknownDtype,
)
from rlfleet.common.tensors._gen import tensors_pb2
from rlfleet.common.tensors.malloc import MMAP_THRESHOLD_BYTES, tuning_enabled

if TYPE_CHECKING:
    import torch
else:
    try:
        import torch
    except ModuleNotFoundError as missing:  # rlfleet-common without its torch extra: numpy arrays only
        if missing.name != "torch":
            raise
        torch = None

logger = logging.getLogger(__name__)

HAVE_TORCH = torch is not None
Arrays = Literal["torch", "numpy"]
"""What received tensors become: torch tensors, or numpy arrays (no bf16, no fp8)."""
DEFAULT_ARRAYS: Arrays = "torch" if HAVE_TORCH else "numpy"

DEFAULT_CHUNK_BYTES = 4 << 20
CHUNK_HINT = "send smaller chunks (chunk_bytes) or raise max_message_bytes where they are received"
# A stream that announces more bytes than this machine has is refused before anything is allocated.
PHYSICAL_MEMORY_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

_CANDIDATES: tuple[tuple[str, str], ...] = (
    ("BOOL", "bool"),
    ("U8", "uint8"),
    ("I8", "int8"),
    ("I16", "int16"),
    ("U16", "uint16"),
    ("I32", "int32"),
    ("U32", "uint32"),
    ("I64", "int64"),
    ("U64", "uint64"),
    ("F16", "float16"),
    ("BF16", "bfloat16"),
    ("F32", "float32"),
    ("F64", "float64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
)

# safetensors dtype name -> torch dtype, for the dtypes this torch build has (none without torch).
DTYPES: dict[str, torch.dtype] = (
    {
        st: getattr(torch, attr)
        for st, attr in _CANDIDATES
        if isinstance(getattr(torch, attr, None), torch.dtype)
    }
    if HAVE_TORCH
    else {}
)
DTYPE_NAMES: dict[torch.dtype, str] = {dt: st for st, dt in DTYPES.items()}
# safetensors dtype name -> numpy dtype (little-endian): all but BF16 and the fp8 ones, which numpy lacks.
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    st: np.dtype(attr).newbyteorder("<") for st, attr in _CANDIDATES if attr in np.sctypeDict
}
NUMPY_DTYPE_NAMES: dict[np.dtype[Any], str] = {dt: st for st, dt in NUMPY_DTYPES.items()}
Tensor = Any
"""A torch tensor, or a numpy array (``torch.Tensor | np.ndarray``; torch may not be installed)."""


def is_torch(tensor: object) -> bool:
    """Whether ``tensor`` is a torch tensor (False for everything where torch is not installed)."""
    return HAVE_TORCH and isinstance(tensor, torch.Tensor)


def dtype_name(dtype: torch.dtype | np.dtype[Any], tensor: str = "") -> str:
    """The safetensors name of a torch or numpy dtype; :class:`UnknownDtype` for one safetensors lacks."""
    if HAVE_TORCH and isinstance(dtype, torch.dtype):
        try:
            return DTYPE_NAMES[dtype]
        except KeyError:
            raise UnknownDtype(str(dtype).removeprefix("torch."), tensor) from None
    name = NUMPY_DTYPE_NAMES.get(dtype) if isinstance(dtype, np.dtype) else None
    if name is None:
        raise UnknownDtype(str(dtype), tensor)
    return name


def torch_dtype(name: str, tensor: str = "") -> torch.dtype:
    """The torch dtype of a safetensors dtype name; :class:`UnknownDtype` for any other string."""
    try:
        return DTYPES[name]
    except KeyError:
        raise UnknownDtype(name, tensor) from None


def numpy_dtype(name: str, tensor: str = "") -> np.dtype[Any]:
    """The numpy dtype of a safetensors dtype name; :class:`UnknownDtype` for any other string and for
    the dtypes numpy lacks (``BF16``, ``F8_*``: they need torch)."""
    try:
        return NUMPY_DTYPES[name]
    except KeyError:
        if name in {st for st, _ in _CANDIDATES}:
            raise UnknownDtype(f"{name} (numpy has no such dtype: decoding it needs torch)", tensor) from None
        raise UnknownDtype(name, tensor) from None


def expected_nbytes(shape: tuple[int, ...], dtype: torch.dtype | np.dtype[Any]) -> int:
    """``prod(shape) * itemsize``: the byte length of a tensor of that shape and dtype."""
    return math.prod(shape) * dtype.itemsize


def payload_nbytes(tensor: Tensor) -> int:
    """A tensor's (or array's) payload bytes, ``numel * itemsize``."""
    return tensor.numel() * tensor.element_size() if is_torch(tensor) else int(tensor.nbytes)


def stored_form(tensor: Tensor) -> Tensor:
    """The tensor as a store keeps it: a contiguous CPU torch tensor, or a C-contiguous numpy array
    (the same object where it already is one)."""
    if is_torch(tensor):
        return tensor.detach().to("cpu").contiguous()
    if isinstance(tensor, np.generic):  # a numpy scalar: a 0-d array
        return np.asarray(tensor)
    if not isinstance(tensor, np.ndarray):
        raise TypeError(f"expected a torch tensor or a numpy array, got {type(tensor).__name__}")
    return np.ascontiguousarray(tensor) if tensor.ndim else tensor


def tensor_buffer(tensor: Tensor) -> memoryview:
    """The tensor's bytes in safetensors layout, as a flat ``uint8`` memoryview.

    Zero-copy for a contiguous CPU tensor or numpy array (the view keeps it alive); others are
    first copied to a contiguous CPU one. Works for every dtype in :data:`DTYPES`, bf16, fp8
    and bool included, for those of :data:`NUMPY_DTYPES`, and for 0-d and empty tensors.
    """
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        raise NotImplementedError("the safetensors layout is little-endian; this host is big-endian")
    if not is_torch(tensor):
        array = stored_form(tensor)
        dtype_name(array.dtype)
        return memoryview(array.reshape(-1).view(np.uint8)).cast("B")
    dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def tensor_to_bytes(tensor: Tensor) -> bytes:
    """The tensor's bytes in safetensors layout, as one new ``bytes`` (a copy)."""
    return bytes(tensor_buffer(tensor))


def bytes_to_tensor(
    data: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...], arrays: Arrays = DEFAULT_ARRAYS
) -> Tensor:
    """A new tensor (or numpy array, ``arrays="numpy"``) of safetensors ``dtype`` and ``shape`` from raw
    bytes (copied).

    Raises :class:`UnknownDtype` for a name outside :data:`DTYPES` (:data:`NUMPY_DTYPES` for numpy)
    and :class:`ShapeMismatch` when the byte count is not ``prod(shape) * itemsize`` (or the shape has
    a negative dimension).
    """
    target = torch_dtype(dtype) if arrays == "torch" else numpy_dtype(dtype)
    shape = tuple(int(d) for d in shape)
    view = memoryview(data).cast("B")
    expected = expected_nbytes(shape, target) if all(d >= 0 for d in shape) else -1
    if len(view) != expected:
        raise ShapeMismatch("", shape, dtype, len(view), expected)
    out = empty_bytes(len(view), arrays)
    if len(view):
        memoryview(out.numpy() if arrays == "torch" else out)[:] = view
    return out.view(target).reshape(shape)


def bytes_to_array(data: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """:func:`bytes_to_tensor` into a numpy array, with or without torch (bf16 and fp8 refused)."""
    return bytes_to_tensor(data, dtype, shape, "numpy")


def checksum(data: bytes | bytearray | memoryview, running: int = 0) -> int:
    """crc32 of ``data`` (the value ``zlib.crc32`` gives), continuing from ``running``.

    zlib-ng's SIMD crc32 runs at 20-50 GB/s where CPython's zlib gives 3-4 GB/s, which made the
    checksum the largest single cost of a stream (benchmarks/README.md).
    """
    return _crc32(data, running)


def tensor_checksum(tensor: Tensor) -> int:
    """crc32 of a tensor's full safetensors-layout bytes."""
    return checksum(tensor_buffer(tensor))


@dataclass(slots=True)
class Chunk:
    """One message of a tensor stream; field for field the ``TensorChunk`` of ``tensors.proto``.

    ``data`` may be a memoryview into a received buffer: the assembler copies it out at once.
    """

    key: str
    name: str = ""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    offset: int = 0
    total_bytes: int = 0
    crc32: int | None = None
    data: bytes | memoryview = b""
    end_of_stream: bool = False
    tensor_count: int = 0


def split_tensors(
    key: str, tensors: Mapping[str, Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[Chunk]:
    """The chunk stream of a dict of tensors: pieces of at most ``chunk_bytes``, then the end marker.

    Lazy: a chunk's ``data`` is a zero-copy view of the tensor, made when the chunk is asked for.
    Every tensor yields at least one chunk (an empty one yields one empty chunk). Raises
    :class:`UnknownDtype` for a tensor safetensors cannot name, before yielding any of its chunks.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    count = 0
    for name, tensor in tensors.items():
        dtype = dtype_name(tensor.dtype, name)
        shape = tuple(tensor.shape)
        buf = tensor_buffer(tensor)
        total = len(buf)
        crc = 0
        offset = 0
        while True:
            piece = buf[offset : offset + chunk_bytes]
            crc = _crc32(piece, crc)
            last = offset + len(piece) >= total
            yield Chunk(key, name, dtype, shape, offset, total, crc if last else None, piece)
            offset += len(piece)
            if last:
                break
        count += 1
    yield Chunk(key, end_of_stream=True, tensor_count=count)


class _Pending:
    """The tensor being received: its destination buffer and how far it is filled."""

    __slots__ = ("name", "dtype", "shape", "total", "buffer", "view", "received", "crc")

    def __init__(self, chunk: Chunk, buffer: Tensor) -> None:
        self.name = chunk.name
        self.dtype = chunk.dtype
        self.shape = chunk.shape
        self.total = chunk.total_bytes
        self.buffer = buffer
        self.view = memoryview(buffer.numpy() if is_torch(buffer) else buffer)
        self.received = 0
        self.crc = 0


class ChunkAssembler:
    """Rebuilds a dict of tensors from its chunk stream, checking every chunk as it arrives.

    ``feed`` each chunk in order, then ``finish``. ``reserve(nbytes)`` is called before a
    tensor's buffer is allocated (a store raises ``StoreFull`` from it); ``max_total_bytes``
    (default: this machine's physical memory, ``None`` for no limit) bounds what a stream may make
    it allocate. Raises, never anything else (but what ``reserve`` raises):
    ``MessageTooLarge`` (a chunk over ``max_chunk_bytes``, or the stream over ``max_total_bytes``),
    ``UnknownDtype``, ``ShapeMismatch``, ``ChecksumMismatch``, ``StreamTruncated`` (a tensor or the
    stream cut short) and ``MalformedChunk`` (wrong key, fields changing mid-tensor, duplicates...).
    After an error the assembler is spent: drop it. ``arrays`` says what the tensors become (torch
    tensors where torch is installed, else numpy arrays, for which a bf16 or fp8 tensor is
    ``UnknownDtype``).
    """

    def __init__(
        self,
        key: str | None = None,
        *,
        max_chunk_bytes: int | None = None,
        max_total_bytes: int | None = PHYSICAL_MEMORY_BYTES,
        reserve: Callable[[int], None] | None = None,
        arrays: Arrays = DEFAULT_ARRAYS,
    ) -> None:
        if arrays == "torch" and not HAVE_TORCH:
            raise ValueError("arrays='torch' needs torch: pip install 'rlfleet-common[torch]'")
        self.key = key
        self.arrays = arrays
        self.max_chunk_bytes = max_chunk_bytes
        self.max_total_bytes = max_total_bytes
        self._reserve = reserve
        self._tensors: dict[str, Tensor] = {}
        self._pending: _Pending | None = None
        self._done = False
        self.nbytes = 0

    @property
    def done(self) -> bool:
        """True once the end-of-stream chunk has been accepted."""
        return self._done

    def feed(self, chunk: Chunk) -> None:
        """Check one chunk and copy its bytes into place."""
        if self._done:
            raise MalformedChunk("chunk after the end-of-stream marker", chunk.key, chunk.name)
        if self.key is None:
            self.key = chunk.key
        elif chunk.key != self.key:
            raise MalformedChunk(f"key changed mid-stream to {chunk.key!r}", self.key, chunk.name)
        if self.max_chunk_bytes is not None and len(chunk.data) > self.max_chunk_bytes:
            raise MessageTooLarge(len(chunk.data), self.max_chunk_bytes, "tensor chunk", CHUNK_HINT)
        if chunk.end_of_stream:
            self._end(chunk)
            return
        pending = self._pending
        if pending is None:
            pending = self._start(chunk)
        elif chunk.name != pending.name:
            raise StreamTruncated(self.key, self._short(pending, f"tensor {chunk.name!r} began"))
        elif (chunk.dtype, chunk.shape, chunk.total_bytes) != (pending.dtype, pending.shape, pending.total):
            raise MalformedChunk("dtype, shape or total_bytes changed mid-tensor", self.key, chunk.name)
        self._copy(pending, chunk)

    def finish(self) -> dict[str, Tensor]:
        """The tensors, once the end marker has arrived; :class:`StreamTruncated` otherwise."""
        if not self._done:
            pending = self._pending
            detail = self._short(pending, "the stream ended") if pending else "no end-of-stream marker"
            raise StreamTruncated(self.key or "", detail)
        return self._tensors

    def _start(self, chunk: Chunk) -> _Pending:
        key = self.key or ""
        if not chunk.name:
            raise MalformedChunk("tensor chunk without a name", key)
        if chunk.name in self._tensors:
            raise MalformedChunk("tensor sent twice", key, chunk.name)
        dtype = (torch_dtype if self.arrays == "torch" else numpy_dtype)(chunk.dtype, chunk.name)
        if any(d < 0 for d in chunk.shape):
            raise MalformedChunk(f"negative dimension in shape {list(chunk.shape)}", key, chunk.name)
        expected = expected_nbytes(chunk.shape, dtype)
        if chunk.total_bytes != expected:
            raise ShapeMismatch(chunk.name, chunk.shape, chunk.dtype, chunk.total_bytes, expected)
        if chunk.offset != 0:
            raise StreamTruncated(key, f"tensor {chunk.name!r} starts at byte {chunk.offset}, not 0")
        if self.max_total_bytes is not None and self.nbytes + expected > self.max_total_bytes:
            raise MessageTooLarge(
                self.nbytes + expected,
                self.max_total_bytes,
                "tensor stream",
                "the receiver refuses streams this large",
            )
        if self._reserve is not None:
            self._reserve(expected)
        self.nbytes += expected
        self._pending = _Pending(chunk, empty_bytes(expected, self.arrays))
        return self._pending

    def _copy(self, pending: _Pending, chunk: Chunk) -> None:
        key = self.key or ""
        if chunk.offset != pending.received:
            raise StreamTruncated(
                key, f"tensor {pending.name!r}: chunk at byte {chunk.offset}, expected {pending.received}"
            )
        end = pending.received + len(chunk.data)
        if end > pending.total:
            raise ShapeMismatch(pending.name, pending.shape, pending.dtype, end, pending.total)
        pending.view[pending.received : end] = chunk.data
        pending.crc = _crc32(chunk.data, pending.crc)
        pending.received = end
        if end < pending.total:
            return
        if chunk.crc32 is None:
            raise MalformedChunk("the tensor's last chunk carries no crc32", key, pending.name)
        if chunk.crc32 != pending.crc:
            raise ChecksumMismatch(pending.name, chunk.crc32, pending.crc)
        dtypes = DTYPES if self.arrays == "torch" else NUMPY_DTYPES
        self._tensors[pending.name] = pending.buffer.view(dtypes[pending.dtype]).reshape(pending.shape)
        self._pending = None

    def _end(self, chunk: Chunk) -> None:
        key = self.key or ""
        if self._pending is not None:
            raise StreamTruncated(key, self._short(self._pending, "the end marker came"))
        detail = f"the end marker counts {chunk.tensor_count} tensors, {len(self._tensors)} came"
        if chunk.tensor_count > len(self._tensors):
            raise StreamTruncated(key, detail)
        if chunk.tensor_count < len(self._tensors):
            raise MalformedChunk(detail, key)
        self._done = True

    @staticmethod
    def _short(pending: _Pending, when: str) -> str:
        return f"{when} with tensor {pending.name!r} at {pending.received} of {pending.total} bytes"


def assemble_tensors(
    chunks: Iterable[Chunk],
    key: str | None = None,
    *,
    max_chunk_bytes: int | None = None,
    max_total_bytes: int | None = PHYSICAL_MEMORY_BYTES,
    arrays: Arrays = DEFAULT_ARRAYS,
) -> dict[str, Tensor]:
    """The dict of tensors a whole chunk stream carries, checked as in :class:`ChunkAssembler`."""
    assembler = ChunkAssembler(
        key, max_chunk_bytes=max_chunk_bytes, max_total_bytes=max_total_bytes, arrays=arrays
    )
    for chunk in chunks:
        assembler.feed(chunk)
    return assembler.finish()


# --- where a received tensor's bytes land --------------------------------------------------------
# A received tensor needs fresh memory, and faulting it in 4 KiB at a time ran at about 1 GiB/s
# (benchmarks/README.md, "tensor_stream"). :func:`empty_bytes` maps tensors of 32 MiB and more with
# ``MADV_HUGEPAGE`` (2 MiB pages), which runs 3-4x faster. Smaller ones come from malloc, where freed
# blocks are reused (:mod:`rlfleet.common.tensors.malloc` keeps them; ``RLFLEET_MALLOC_TUNING=0``
# turns both off).

HUGE_ALLOC_BYTES = MMAP_THRESHOLD_BYTES  # from here on malloc would mmap fresh pages anyway
_HUGE_PAGE = 2 << 20


def empty_bytes(nbytes: int, arrays: Arrays = DEFAULT_ARRAYS) -> Tensor:
    """A new, uninitialised ``uint8`` tensor (or numpy array) of ``nbytes`` (nbytes,), on huge pages
    when it is big.

    The huge-page buffer is an anonymous mapping that the tensor keeps alive and that is unmapped
    with it; it cannot be resized in place.
    """
    numpy = arrays == "numpy"
    if nbytes < HUGE_ALLOC_BYTES or not tuning_enabled() or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(nbytes, dtype=np.uint8) if numpy else torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    if numpy:
        flat = np.frombuffer(region, dtype=np.uint8)
        skip = -flat.ctypes.data % _HUGE_PAGE
        return flat[skip : skip + nbytes]
    whole = torch.frombuffer(region, dtype=torch.uint8)
    skip = -whole.data_ptr() % _HUGE_PAGE  # start on a 2 MiB boundary so every page can be huge
    return whole[skip : skip + nbytes]


# --- chunks as protobuf bytes (TensorChunk), without copying the payload twice -----------------------

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
