"""Peak memory of a process tree: summed RSS sampled often, PSS now and then (benchmarks/vs_trl.py)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

GIB = 1024**3


class TreeMemory:
    """Samples the summed RSS of a process and all its descendants until stopped, and now and then PSS.

    RSS (``/proc/<pid>/statm``) is cheap and read every ``interval`` s. PSS needs the kernel to walk
    every page table (about 80 ms of CPU for a vLLM process here), so it is read every ``pss_every``
    s only (0: never): its peak is a lower bound, and the sampling costs the measured run little.
    """

    def __init__(self, pid: int, interval: float, pss_every: float) -> None:
        self.pid, self.interval, self.pss_every = pid, interval, pss_every
        self.peak_rss = self.peak_pss = self.peak_procs = 0
        self.peak_load = 0.0
        self._last_pss = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        with_pss = self.pss_every > 0 and time.monotonic() - self._last_pss >= self.pss_every
        rss = pss = 0
        for proc in procs:
            try:
                info = proc.memory_full_info() if with_pss else proc.memory_info()
            except psutil.Error:  # gone between listing and reading
                continue
            rss, pss = rss + info.rss, pss + getattr(info, "pss", 0)
        if with_pss:
            self._last_pss, self.peak_pss = time.monotonic(), max(self.peak_pss, pss)
        self.peak_rss, self.peak_procs = max(self.peak_rss, rss), max(self.peak_procs, len(procs))
        self.peak_load = max(self.peak_load, os.getloadavg()[0])

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def report(self) -> dict[str, Any]:
        return {"peak_rss_gib": round(self.peak_rss / GIB, 3),
                "peak_pss_gib_sampled": round(self.peak_pss / GIB, 3) if self.pss_every > 0 else None,
                "peak_processes": self.peak_procs, "load_avg_1m_max": round(self.peak_load, 2)}  # fmt: skip
