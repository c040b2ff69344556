"""Who may touch a TensorStore: its secret, the per-key capabilities it hands out, unpredictable keys.

Each :class:`~rlfleet.common.tensors.server.TensorStoreServer` draws a random secret when it is
made. The process that owns the store (and anyone it gives the secret to) may ``Put``, ``Delete``
and ``Stat`` anything: it sends the secret as a bearer token (``authorization: Bearer ...`` in the
gRPC metadata). Everyone else reads only what a :class:`~rlfleet.common.schema.refs.TensorRef`
names: the ref carries a *capability*, an HMAC-SHA256 of its key under the secret, which the store
checks before it streams a byte. A capability only reads: releasing a key (``Delete``) is the
owner's alone, so no reader can drop a batch before the others have read it. A capability opens
one key of one store and cannot be turned into another's; keys carry a random suffix, so they
cannot be guessed either.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping

AUTHORIZATION_KEY = "authorization"
CAPABILITY_KEY = "rlfleet-capability"
_BEARER = "Bearer "
SECRET_BYTES = 32
KEY_SUFFIX_BYTES = 12


def new_secret() -> str:
    """A fresh store secret (URL-safe text, 256 random bits)."""
    return secrets.token_urlsafe(SECRET_BYTES)


def unpredictable_key(key: str) -> str:
    """``key`` with a random suffix: what a store really stores under (``weights/v3/0.Zk3...``)."""
    return f"{key}.{secrets.token_urlsafe(KEY_SUFFIX_BYTES)}"


def capability(secret: str, key: str) -> str:
    """The capability that opens ``key`` in the store holding ``secret`` (hex HMAC-SHA256)."""
    return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()


def bearer_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata an owner's call carries."""
    return ((AUTHORIZATION_KEY, _BEARER + secret),)


def capability_metadata(cap: str) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata a reader's call carries (nothing when it has no capability)."""
    return ((CAPABILITY_KEY, cap),) if cap else ()


class StoreGuard:
    """The checks a store makes on each call's metadata (all comparisons in constant time)."""

    def __init__(self, secret: str | None = None) -> None:
        self.secret = secret or new_secret()

    def capability(self, key: str) -> str:
        return capability(self.secret, key)

    def is_owner(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """Whether the call carries this store's secret as its bearer token."""
        token = _value(metadata, AUTHORIZATION_KEY)
        if not token.startswith(_BEARER):
            return False
        return hmac.compare_digest(token[len(_BEARER) :].encode(), self.secret.encode())

    def may_open(self, key: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """Whether the call may read ``key`` (``Get``, ``Stat``): the owner, or the key's capability."""
        if self.is_owner(metadata):
            return True
        cap = _value(metadata, CAPABILITY_KEY)
        return bool(cap) and hmac.compare_digest(cap.encode(), self.capability(key).encode())


def _value(metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None, name: str) -> str:
    """The first value of ``name`` in a call's metadata, as text ('' when absent or not text)."""
    if metadata is None:
        return ""
    items = metadata.items() if isinstance(metadata, Mapping) else metadata
    for key, value in items:
        if key == name:
            return value if isinstance(value, str) else ""
    return ""
