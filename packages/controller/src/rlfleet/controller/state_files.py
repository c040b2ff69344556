"""Files the controller keeps state in, written so that a crash never leaves half of one.

A controller can be killed at any instant (SIGKILL, a lost machine) and a later run reads what it
wrote: ``controller_state.json`` of a checkpoint (``resume_from=auto`` trusts a checkpoint that
has one), ``processes.json``, the run's ``config.yaml``, the workers' config files. Each is written
to a temporary file in the same directory, flushed to disk, and renamed over the old one
(``os.replace`` is atomic on POSIX), then the directory itself is synced so that the rename
survives a power loss: a reader sees the old file or the new one, never a mix.
"""

from __future__ import annotations

from rlfleet.common.atomic_files import write_atomic

__all__ = ["write_atomic"]  # one implementation for every tier (rlfleet.common.atomic_files)
