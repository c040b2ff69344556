"""Records when each rlfleet source file is called, in every process of a run (a test helper).

Loaded by Python at start-up when this folder is on ``PYTHONPATH`` (the test that counts the
files one training step passes through puts it there for ``rlfleet train`` and, through the
inherited environment, every worker the launcher starts). With ``RLFLEET_TRACE_OUT`` set, each
process writes ``<pid>.json`` there when it exits: ``{file: [twentieths of a second since the
epoch in which the file's functions were called]}``.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

_OUT = os.environ.get("RLFLEET_TRACE_OUT")

if _OUT:
    _seen: dict[str, set[int]] = {}
    _MARK = f"{os.sep}rlfleet{os.sep}"

    def _profile(frame, event, arg):  # noqa: ANN001, ANN202 - the sys.setprofile signature
        if event == "call":
            name = frame.f_code.co_filename
            if _MARK in name:
                _seen.setdefault(name, set()).add(int(time.time() * 20))

    def _dump() -> None:
        sys.setprofile(None)
        with open(os.path.join(_OUT, f"{os.getpid()}.json"), "w") as out:
            json.dump({name: sorted(bins) for name, bins in _seen.items()}, out)

    atexit.register(_dump)
    threading.setprofile(_profile)
    sys.setprofile(_profile)
