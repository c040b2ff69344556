"""``rlfleet env``: what a bug report needs to know about this machine, one ``name: value`` a line.

The versions of the rlfleet packages and of the libraries a run leans on (torch, transformers,
vLLM, ray, nats-py, grpcio, pydantic), Python and the platform, whether CUDA is available (its
version, the GPUs' names), and the CPU's features that decide CPU bf16 (``avx512_bf16``, ``amx``).
A package that is not installed reads ``not installed``; nothing here starts a process or a GPU
context beyond torch's own query of the devices.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

RLFLEET_PACKAGES = (
    "rlfleet-common",
    "rlfleet-controller",
    "rlfleet-rollout",
    "rlfleet-reward",
    "rlfleet-trainer",
)
LIBRARIES = ("torch", "transformers", "vllm", "ray", "nats-py", "grpcio", "pydantic", "safetensors")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The CPU features reported (from /proc/cpuinfo): AVX-512 BF16 and AMX make CPU bf16 fast."""


def version(package: str) -> str:
    """The installed version of ``package``, or ``not installed``."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """Which of :data:`CPU_FLAGS` the CPU has (``avx2 avx512_bf16``), ``none``, or ``unknown``."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
            break
    found = [flag for flag in CPU_FLAGS if flag in flags]
    return " ".join(found) if found else "none of " + " ".join(CPU_FLAGS)


def cuda() -> list[tuple[str, str]]:
    """CUDA as torch sees it: available or not, its version, the devices."""
    try:
        import torch
    except ImportError:
        return [("cuda", "unknown (torch not installed)")]
    if not torch.cuda.is_available():
        return [("cuda", f"not available (torch built for CUDA {torch.version.cuda or 'none'})")]
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [("cuda", f"available, CUDA {torch.version.cuda}"), ("gpus", f"{len(names)}: {', '.join(names)}")]


def report(gpu: Callable[[], list[tuple[str, str]]] = cuda) -> list[tuple[str, str]]:
    """``(name, value)`` rows: packages, Python, platform, CPU, CUDA."""
    rows = [(name, version(name)) for name in (*RLFLEET_PACKAGES, *LIBRARIES)]
    rows += [("python", f"{platform.python_version()} ({sys.executable})"), ("platform", platform.platform()),
             ("cpu", f"{platform.machine()}, flags: {cpu_flags()}")]  # fmt: skip
    return rows + gpu()


def render(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows) + "\n"
