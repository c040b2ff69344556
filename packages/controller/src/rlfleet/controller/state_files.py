"""Files the controller keeps state in, written so that a crash never leaves half of one.

A controller can be killed at any instant (SIGKILL, a lost machine) and a later run reads what it
wrote: ``controller_state.json`` of a checkpoint (``resume_from=auto`` trusts a checkpoint that
has one), ``processes.json``, the run's ``config.yaml``, the workers' config files. Each is written
to a temporary file in the same directory, flushed to disk, and renamed over the old one
(``os.replace`` is atomic on POSIX), then the directory itself is synced so that the rename
survives a power loss: a reader sees the old file or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_atomic(path: str | Path, text: str, *, mode: int = 0o644) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) in one step; ``mode`` is the new file's permissions
    (0o600 for a file holding a secret: it never exists with wider ones)."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
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
    _sync_dir(target.parent)
    return target


def _sync_dir(directory: Path) -> None:
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
