"""Child processes that do not outlive their parent.

``die_with_parent`` runs in a child between fork and exec and asks Linux to send it SIGTERM
when the process that started it dies (``PR_SET_PDEATHSIG``), so a controller killed outright
leaves no nats-server or worker behind. Elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return None


_PRCTL = _load_prctl()  # looked up in the parent: the child between fork and exec only calls it


def die_with_parent() -> None:
    """``preexec_fn`` for subprocess.Popen: SIGTERM this child when its parent dies."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
