"""The in-memory heart of a TensorStore: keyed dicts of tensors with a byte capacity and a TTL.

:class:`LocalTensorStore` is what :class:`~rlfleet.common.tensors.server.TensorStoreServer` serves,
and works on its own in one process (the in-memory side of the tensor-plane seam). It is
thread-safe: an engine thread may ``put`` while the event loop streams a ``get``.

Accounting is in payload bytes (``numel * itemsize``). A streamed put first *reserves* its bytes,
tensor by tensor as they are announced, and only *commits* when the whole stream has arrived and
checked out; a put that fails or is cut off releases its reservation and is never visible. A put
never replaces a key: one under a key already held raises :class:`KeyExists` (delete it first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rlfleet.common.errors import KeyExists, MalformedChunk, StoreFull, UnknownKey, UnknownTensor
from rlfleet.common.tensors.codec import Tensor, dtype_name, payload_nbytes, stored_form

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What one stored tensor is, without its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class StoreStat:
    """Store-wide accounting, plus one key's tensors when a key was asked about."""

    used_bytes: int
    capacity_bytes: int
    key_count: int
    tensors: tuple[TensorInfo, ...] = ()
    expires_in_s: float | None = None
    max_message_bytes: int = 0  # the largest chunk payload a server accepts; 0 when not a server


@dataclass(slots=True)
class _Entry:
    tensors: dict[str, Tensor]
    nbytes: int
    expires_at: float


def _payload_bytes(tensors: Mapping[str, Tensor]) -> int:
    return sum(payload_nbytes(t) for t in tensors.values())


class Reservation:
    """Bytes set aside for one streamed put; ``commit`` stores it, ``release`` gives the room back."""

    def __init__(self, store: LocalTensorStore) -> None:
        self._store = store
        self.nbytes = 0
        self.closed = False

    def add(self, nbytes: int) -> None:
        """Reserve ``nbytes`` more; :class:`StoreFull` (reserving nothing) if they do not fit."""
        self._store._reserve(self, nbytes)

    def commit(self, key: str, tensors: dict[str, Tensor]) -> int:
        """Make the put visible under ``key``; returns its payload bytes."""
        return self._store._commit(self, key, tensors)

    def release(self) -> None:
        """Give back whatever was reserved and not committed; safe to call more than once."""
        self._store._release(self)


class LocalTensorStore:
    """Keyed dicts of CPU tensors (torch tensors or numpy arrays), bounded by ``capacity_bytes``,
    each kept ``ttl_s`` after its put."""

    def __init__(
        self, *, capacity_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity_bytes < 0 or ttl_s <= 0:
            raise ValueError(f"capacity_bytes must be >= 0 and ttl_s > 0, got {capacity_bytes}, {ttl_s}")
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._used = 0
        self._reserved = 0

    @property
    def used_bytes(self) -> int:
        """Payload bytes of the live entries (reservations of puts in flight not included)."""
        with self._lock:
            self._purge_locked()
            return self._used

    @property
    def reserved_bytes(self) -> int:
        """Bytes held for streamed puts that have not committed yet."""
        with self._lock:
            return self._reserved

    @property
    def keys(self) -> list[str]:
        """The live keys, oldest put first."""
        with self._lock:
            self._purge_locked()
            return list(self._entries)

    def put(self, key: str, tensors: Mapping[str, Tensor]) -> int:
        """Store ``tensors`` under a new ``key`` at once; returns the payload bytes.

        Keeps references, not copies, of CPU contiguous tensors: do not modify them in place after.
        Raises :class:`UnknownDtype`, :class:`StoreFull` or :class:`KeyExists` (a live key is never
        overwritten), leaving the store as it was.
        """
        stored = {name: stored_form(t) for name, t in tensors.items()}
        for name, tensor in stored.items():
            dtype_name(tensor.dtype, name)
        reservation = self.reserve()
        try:
            reservation.add(_payload_bytes(stored))
            return reservation.commit(key, stored)
        finally:
            reservation.release()

    def reserve(self) -> Reservation:
        """An empty reservation for a streamed put."""
        return Reservation(self)

    def get(self, key: str, names: Sequence[str] | None = None) -> dict[str, Tensor]:
        """The tensors under ``key`` (all, or ``names`` in that order); shared, not copied.

        Raises :class:`UnknownKey` (never put, expired, deleted) or :class:`UnknownTensor`.
        """
        with self._lock:
            self._purge_locked()
            entry = self._entries.get(key)
            if entry is None:
                raise UnknownKey(key)
            if not names:
                return dict(entry.tensors)
            missing = [n for n in names if n not in entry.tensors]
            if missing:
                raise UnknownTensor(key, missing[0], tuple(entry.tensors))
            return {n: entry.tensors[n] for n in dict.fromkeys(names)}

    def delete(self, key: str) -> bool:
        """Drop ``key``; False if it was not there."""
        with self._lock:
            self._purge_locked()
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._used -= entry.nbytes
            return True

    def stat(self, key: str | None = None) -> StoreStat:
        """Accounting, and ``key``'s tensors when given (:class:`UnknownKey` if it is not there)."""
        with self._lock:
            self._purge_locked()
            base = StoreStat(self._used, self.capacity_bytes, len(self._entries))
            if key is None:
                return base
            entry = self._entries.get(key)
            if entry is None:
                raise UnknownKey(key)
            infos = tuple(
                TensorInfo(n, dtype_name(t.dtype), tuple(t.shape), payload_nbytes(t))
                for n, t in entry.tensors.items()
            )
            remaining = max(0.0, entry.expires_at - self._clock())
            return StoreStat(base.used_bytes, base.capacity_bytes, base.key_count, infos, remaining)

    def purge_expired(self) -> int:
        """Drop the entries whose TTL has run out; returns how many."""
        with self._lock:
            return self._purge_locked()

    def _purge_locked(self) -> int:
        now = self._clock()
        expired = [k for k, e in self._entries.items() if e.expires_at <= now]
        for key in expired:
            self._used -= self._entries.pop(key).nbytes
        if expired:
            logger.debug("expired %d TensorStore keys", len(expired))
        return len(expired)

    def _reserve(self, reservation: Reservation, nbytes: int) -> None:
        with self._lock:
            if reservation.closed:
                raise RuntimeError("reservation already committed or released")
            self._purge_locked()
            in_use = self._used + self._reserved
            if in_use + nbytes > self.capacity_bytes:
                raise StoreFull(reservation.nbytes + nbytes, in_use - reservation.nbytes, self.capacity_bytes)
            self._reserved += nbytes
            reservation.nbytes += nbytes

    def _commit(self, reservation: Reservation, key: str, tensors: dict[str, Tensor]) -> int:
        if not key:
            raise MalformedChunk("a put needs a non-empty key")
        nbytes = _payload_bytes(tensors)
        with self._lock:
            if reservation.closed or nbytes != reservation.nbytes:
                raise RuntimeError(f"commit of {nbytes} bytes against a reservation of {reservation.nbytes}")
            self._purge_locked()
            if key in self._entries:
                raise KeyExists(key)
            self._entries[key] = _Entry(tensors, nbytes, self._clock() + self.ttl_s)
            self._used += nbytes
            self._reserved -= nbytes
            reservation.closed = True
            return nbytes

    def _release(self, reservation: Reservation) -> None:
        with self._lock:
            if not reservation.closed:
                self._reserved -= reservation.nbytes
                reservation.closed = True
