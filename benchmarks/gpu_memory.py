"""The GPU's peak memory in use while something runs: ``nvidia-smi`` every 0.2 s, every process on
the card (the only figure that counts a vLLM engine core, a trainer and CUDA contexts together)."""

from __future__ import annotations

import shutil
import subprocess
import threading


class GpuMemory:
    """The card's peak memory in use while the job runs (``nvidia-smi`` every 0.2 s, all processes)."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                text = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                self.peak_mib = max(self.peak_mib, int(text.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return
            self._stop.wait(0.2)

    def __enter__(self) -> GpuMemory:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
