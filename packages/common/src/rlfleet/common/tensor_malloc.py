"""Make glibc's malloc keep the buffers a tensor stream churns through (a process-wide setting).

Every chunk a TensorStore stream moves passes through short-lived buffers of a few MiB: gRPC's
socket read buffers, the message ``bytes`` it builds, the chunk we encode. By default glibc serves
blocks that large with a fresh ``mmap`` (or trims the heap as soon as they are freed), so each
chunk lands on fresh pages: a page fault and a page clear per 4 KiB, which costs about as much as
copying the data once more. Profiles of a 512 MiB stream spent over a third of the receiver's CPU
there (benchmarks/README.md, "tensor_stream"). Raising ``M_MMAP_THRESHOLD`` and
``M_TRIM_THRESHOLD`` makes glibc reuse those blocks instead; the price is that up to
``trim_threshold`` bytes of freed memory stay with the process.

The TensorStore server and client call :func:`keep_stream_buffers` once per process; set
``RLFLEET_MALLOC_TUNING=0`` to leave malloc alone. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit systems
TRIM_THRESHOLD_BYTES = 512 << 20

_lock = threading.Lock()
_done: bool | None = None


def keep_stream_buffers(
    mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES
) -> bool:
    """Tune glibc malloc for streaming, once per process; True if this process's malloc is tuned."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        _done = _apply(mmap_threshold, trim_threshold)
        return _done


def _apply(mmap_threshold: int, trim_threshold: int) -> bool:
    if os.environ.get("RLFLEET_MALLOC_TUNING", "1") == "0":
        logger.info("RLFLEET_MALLOC_TUNING=0: leaving malloc as it is")
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    gnu_version = getattr(libc, "gnu_get_libc_version", None)
    mallopt = getattr(libc, "mallopt", None)
    if gnu_version is None or mallopt is None:  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    logger.info(
        "malloc tuned for tensor streams: M_MMAP_THRESHOLD=%d, M_TRIM_THRESHOLD=%d (%s)",
        mmap_threshold,
        trim_threshold,
        "ok" if ok else "refused",
    )
    return ok
