"""Where a run finds the user's own Python code: ``module:function`` names next to the user's files.

A job names code by ``package.module:function``: a reward spec (``reward: my_rewards:fn``, imported
by the reward worker) or a ``rollout_fn`` (imported by the controller). The module is often a
file of the user's project, not an installed package: ``my_rewards.py`` in the directory
``rlfleet train`` runs in, or next to the job file. A worker is a console script, whose import
path holds its own ``bin`` folder, not the directory it runs in, so the run puts the user's
folders on every import path itself:

- the folders: the controller's working directory, then ``TrainerConfig.python_path`` (the CLI
  adds the job file's folder there), absolute, each once (:func:`code_dirs`);
- every worker the run starts, by the embedded launcher or the Ray launcher, gets them first on
  its ``PYTHONPATH``, ahead of the one it inherits (:func:`worker_pythonpath`; a worker on another
  Ray node gets the same paths, which hold the code only where that node shares the files);
- the controller imports a ``rollout_fn`` with them on ``sys.path`` (:func:`import_user_function`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from rlfleet.common.errors import ConfigError


def code_dirs(extra: Iterable[str] = ()) -> list[str]:
    """The working directory, then ``extra`` (a config's ``python_path``): absolute, each once."""
    return list(dict.fromkeys(os.path.abspath(d) for d in [os.getcwd(), *extra]))


def worker_pythonpath(dirs: Iterable[str], inherited: str | None) -> str:
    """A worker's ``PYTHONPATH``: ``dirs`` first, then what it inherits, each entry once."""
    entries = [*dirs, *(inherited or "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def on_sys_path(dirs: Iterable[str]) -> None:
    """Put ``dirs`` on this process's import path (after what is there: installed code wins)."""
    for folder in dirs:
        if folder not in sys.path:
            sys.path.append(folder)


def import_user_function(name: str, field: str, extra: Iterable[str] = ()) -> Callable[..., Any]:
    """The callable ``package.module:function`` names, importable from :func:`code_dirs` too, or a
    :class:`ConfigError` about the config field ``field`` that names it."""
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ConfigError(field, name, "expected 'package.module:function'")
    dirs = code_dirs(extra)
    on_sys_path(dirs)
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        where = os.pathsep.join(dirs)
        raise ConfigError(field, name, f"cannot import it ({exc}; searched {where} too)") from None
    if not callable(fn):
        raise ConfigError(field, name, f"{type(fn).__name__} is not callable")
    return fn
