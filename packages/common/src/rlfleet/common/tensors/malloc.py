"""glibc malloc tuned for tensor streams: chunk buffers are reused, not mapped afresh each time.

Every chunk passes through short-lived buffers of a few MiB: gRPC's socket read buffers, the
message ``bytes`` it builds, the chunk we encode. By default glibc serves blocks that large with a
fresh ``mmap`` (or trims the heap as soon as they are freed), so each chunk lands on fresh pages:
a page fault and a page clear per 4 KiB, over a third of the receiver's CPU in profiles of a
512 MiB stream (benchmarks/README.md, "tensor_stream"). :func:`keep_stream_buffers` raises
``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` so that glibc reuses them; up to ``trim_threshold``
bytes of freed memory then stay with the process. The TensorStore server and client call it once
per process; elsewhere than Linux with glibc it leaves malloc alone.

``RLFLEET_MALLOC_TUNING=0`` (:func:`tuning_enabled`) turns this off, and with it the huge pages
that :func:`rlfleet.common.tensors.codec.empty_bytes` maps for big received tensors.
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
_tuned: bool | None = None


def tuning_enabled() -> bool:
    """False when ``RLFLEET_MALLOC_TUNING=0`` asks to leave memory management alone."""
    return os.environ.get("RLFLEET_MALLOC_TUNING", "1") != "0"


def keep_stream_buffers(
    mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES
) -> bool:
    """Tune glibc malloc for streaming, once per process; True if this process's malloc is tuned."""
    global _tuned
    with _lock:
        if _tuned is None:
            _tuned = _apply(mmap_threshold, trim_threshold)
        return _tuned


def _apply(mmap_threshold: int, trim_threshold: int) -> bool:
    if not tuning_enabled():
        logger.info("RLFLEET_MALLOC_TUNING=0: leaving malloc as it is")
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if getattr(libc, "gnu_get_libc_version", None) is None or mallopt is None:  # musl, macOS
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
