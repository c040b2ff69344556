"""Where a run finds the user's code: the working directory and python_path, first on every
worker's PYTHONPATH (embedded and Ray-hosted), and on the controller's import path for rollout_fn."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlfleet.common.errors import ConfigError
from rlfleet.controller.ray_worker_host import with_pythonpath
from rlfleet.controller.routing import import_rollout_fn
from rlfleet.controller.user_code import code_dirs, worker_pythonpath


def test_the_working_directory_then_python_path_go_first_each_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    jobs = tmp_path / "jobs"
    dirs = code_dirs([str(jobs), ".", str(jobs)])
    assert dirs == [str(tmp_path), str(jobs)]
    assert worker_pythonpath(dirs, f"/site{os.pathsep}{jobs}").split(os.pathsep) == [
        str(tmp_path), str(jobs), "/site",
    ]  # fmt: skip
    assert worker_pythonpath(dirs, None) == os.pathsep.join(dirs)


def test_a_ray_hosted_worker_keeps_its_nodes_pythonpath_after_the_runs() -> None:
    node = {"PATH": "/bin", "PYTHONPATH": "/node/lib"}
    merged = with_pythonpath(node, {"PYTHONPATH": f"/work{os.pathsep}/jobs", "PYTHONUNBUFFERED": "1"})
    assert merged["PYTHONPATH"].split(os.pathsep) == ["/work", "/jobs", "/node/lib"]
    assert merged["PATH"] == "/bin" and merged["PYTHONUNBUFFERED"] == "1"
    assert with_pythonpath(node, {"X": "1"})["PYTHONPATH"] == "/node/lib"


def test_rollout_fn_imports_from_the_job_folder(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs_folder_only"
    jobs.mkdir()
    (jobs / "routes_next_to_job_xyz.py").write_text("def route(item):\n    return 'small'\n")
    with pytest.raises(ConfigError, match="cannot import it"):
        import_rollout_fn("routes_next_to_job_xyz:route")
    fn = import_rollout_fn("routes_next_to_job_xyz:route", [str(jobs)])
    assert fn(None) == "small"
