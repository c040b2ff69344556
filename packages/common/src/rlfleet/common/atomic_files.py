"""Files written so that a crash never leaves half of one: any tier's state that a restart reads back.

A process can be killed at any instant (SIGKILL, a lost machine) and its next life reads what it
wrote: the controller's ``controller_state.json`` and ``processes.json``, a reward server's
endpoint states. Each is written to a temporary file in the same directory, flushed to disk, and
renamed over the old one (``os.replace`` is atomic on POSIX), then the directory itself is synced
so that the rename survives a power loss: a reader sees the old file or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PARTIAL_SUFFIX = ".tmp"
"""How the name of a file still being written ends (``.<name>.<pid>.tmp``): readers skip such files."""


def write_atomic(path: str | Path, text: str, *, mode: int = 0o644) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) in one step; ``mode`` is the new file's permissions
    (0o600 for a file holding a secret: it never exists with wider ones)."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}{PARTIAL_SUFFIX}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(partial, mode)  # whatever the umask took off
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        raise
    sync_dir(target.parent)
    return target


def sync_dir(directory: Path) -> None:
    """fsync a directory so that a rename in it is on disk (not every filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
