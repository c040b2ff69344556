"""Tensors as safetensors-layout bytes, and a dict of tensors as a validated stream of chunks.

The layout is safetensors' raw one: a tensor's elements, contiguous, row-major, little-endian,
named by safetensors' dtype names (``BF16``, ``F32``, ...). A dict of tensors travels as
:class:`Chunk` s: each tensor's bytes cut in order into pieces of at most ``chunk_bytes``, the
tensor's crc32 on its last piece, then one end-of-stream chunk that counts the tensors.
:func:`split_tensors` makes that stream and :class:`ChunkAssembler` (or :func:`assemble_tensors`)
checks every field while rebuilding the tensors, raising the tensor-plane errors of
:mod:`rlfleet.common.errors` and nothing else. ``tensors.wire`` turns chunks into protobuf bytes.
A big received tensor lands on huge pages (:func:`empty_bytes`, at the end of this module).

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

import torch
from zlib_ng.zlib_ng import crc32 as _crc32

from rlfleet.common.errors import (
    ChecksumMismatch,
    MalformedChunk,
    MessageTooLarge,
    ShapeMismatch,
    StreamTruncated,
    UnknownDtype,
)
from rlfleet.common.tensors.malloc import MMAP_THRESHOLD_BYTES, tuning_enabled

logger = logging.getLogger(__name__)

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

# safetensors dtype name -> torch dtype, for the dtypes this torch build has.
DTYPES: dict[str, torch.dtype] = {
    st: getattr(torch, attr)
    for st, attr in _CANDIDATES
    if isinstance(getattr(torch, attr, None), torch.dtype)
}
DTYPE_NAMES: dict[torch.dtype, str] = {dt: st for st, dt in DTYPES.items()}


def dtype_name(dtype: torch.dtype, tensor: str = "") -> str:
    """The safetensors name of a torch dtype; :class:`UnknownDtype` for one safetensors lacks."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise UnknownDtype(str(dtype).removeprefix("torch."), tensor) from None


def torch_dtype(name: str, tensor: str = "") -> torch.dtype:
    """The torch dtype of a safetensors dtype name; :class:`UnknownDtype` for any other string."""
    try:
        return DTYPES[name]
    except KeyError:
        raise UnknownDtype(name, tensor) from None


def expected_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """``prod(shape) * itemsize``: the byte length of a tensor of that shape and dtype."""
    return math.prod(shape) * dtype.itemsize


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in safetensors layout, as a flat ``uint8`` memoryview.

    Zero-copy for a contiguous CPU tensor (the view keeps the tensor alive); other tensors are
    first copied to a contiguous CPU tensor. Works for every dtype in :data:`DTYPES`, bf16, fp8
    and bool included, and for 0-d and empty tensors.
    """
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        raise NotImplementedError("the safetensors layout is little-endian; this host is big-endian")
    dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes in safetensors layout, as one new ``bytes`` (a copy)."""
    return bytes(tensor_buffer(tensor))


def bytes_to_tensor(data: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor of safetensors ``dtype`` and ``shape`` from raw bytes (copied).

    Raises :class:`UnknownDtype` for a name outside :data:`DTYPES` and :class:`ShapeMismatch` when
    the byte count is not ``prod(shape) * itemsize`` (or the shape has a negative dimension).
    """
    torch_dt = torch_dtype(dtype)
    shape = tuple(int(d) for d in shape)
    view = memoryview(data).cast("B")
    expected = expected_nbytes(shape, torch_dt) if all(d >= 0 for d in shape) else -1
    if len(view) != expected:
        raise ShapeMismatch("", shape, dtype, len(view), expected)
    out = empty_bytes(len(view))
    if len(view):
        memoryview(out.numpy())[:] = view
    return out.view(torch_dt).reshape(shape)


def checksum(data: bytes | bytearray | memoryview, running: int = 0) -> int:
    """crc32 of ``data`` (the value ``zlib.crc32`` gives), continuing from ``running``.

    zlib-ng's SIMD crc32 runs at 20-50 GB/s where CPython's zlib gives 3-4 GB/s, which made the
    checksum the largest single cost of a stream (benchmarks/README.md).
    """
    return _crc32(data, running)


def tensor_checksum(tensor: torch.Tensor) -> int:
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
    key: str, tensors: Mapping[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES
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

    def __init__(self, chunk: Chunk, buffer: torch.Tensor) -> None:
        self.name = chunk.name
        self.dtype = chunk.dtype
        self.shape = chunk.shape
        self.total = chunk.total_bytes
        self.buffer = buffer
        self.view = memoryview(buffer.numpy())
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
    After an error the assembler is spent: drop it.
    """

    def __init__(
        self,
        key: str | None = None,
        *,
        max_chunk_bytes: int | None = None,
        max_total_bytes: int | None = PHYSICAL_MEMORY_BYTES,
        reserve: Callable[[int], None] | None = None,
    ) -> None:
        self.key = key
        self.max_chunk_bytes = max_chunk_bytes
        self.max_total_bytes = max_total_bytes
        self._reserve = reserve
        self._tensors: dict[str, torch.Tensor] = {}
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

    def finish(self) -> dict[str, torch.Tensor]:
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
        dtype = torch_dtype(chunk.dtype, chunk.name)
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
        self._pending = _Pending(chunk, empty_bytes(expected))
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
        self._tensors[pending.name] = pending.buffer.view(DTYPES[pending.dtype]).reshape(pending.shape)
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
) -> dict[str, torch.Tensor]:
    """The dict of tensors a whole chunk stream carries, checked as in :class:`ChunkAssembler`."""
    assembler = ChunkAssembler(key, max_chunk_bytes=max_chunk_bytes, max_total_bytes=max_total_bytes)
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


def empty_bytes(nbytes: int) -> torch.Tensor:
    """A new, uninitialised ``uint8`` tensor of ``nbytes`` (nbytes,), on huge pages when it is big.

    The huge-page buffer is an anonymous mapping that the tensor keeps alive and that is unmapped
    with it; it cannot be resized in place.
    """
    if nbytes < HUGE_ALLOC_BYTES or not tuning_enabled() or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    skip = -whole.data_ptr() % _HUGE_PAGE  # start on a 2 MiB boundary so every page can be huge
    return whole[skip : skip + nbytes]
