"""``rlfleet`` exit codes: 2 with one line for every user mistake, 1 with one line for a runtime failure,
a traceback (and 1) for a crash; every controller error is one or the other."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from rlfleet.common.errors import Failure, RemoteUserError, UserError
from rlfleet.controller import cli, errors
from rlfleet.controller.errors import CheckpointNotFound, SettingsConflict, TierDied

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny_grpo.yaml"


def test_every_controller_error_is_a_user_error_or_a_failure() -> None:
    found = [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, Exception) and cls.__module__ == errors.__name__
    ]
    assert TierDied in found and SettingsConflict not in found  # common's, re-exported
    assert [cls for cls in found if issubclass(cls, UserError) == issubclass(cls, Failure)] == []


def test_a_missing_checkpoint_exits_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert cli.main(["train", str(TINY), f"output_dir={out}", "resume_from=/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlfleet: cannot resume from '/nonexistent'"), err
    assert not (out / "fleet").exists(), "nothing may be spawned for a missing checkpoint"


def test_a_malformed_cpu_bf16_override_exits_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLFLEET_CPU_BF16", "yes")
    out = tmp_path / "run"
    assert cli.main(["train", str(TINY), f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RLFLEET_CPU_BF16 must be 0 or 1" in err[0] and "'yes'" in err[0], err
    assert not out.exists(), "nothing may be spawned for a malformed environment"
    model = "model={name: 'tiny:digits', mixed_precision: none}"  # the example writes model: tiny:digits
    assert cli.main(["config", str(TINY), model]) == 0  # read only for auto


@pytest.mark.parametrize(
    ("error", "code", "needle"),
    [
        (SettingsConflict("trainer-0", tier="trainer", detail="sharding: run 'full',\n worker 'none'"), 2,
         "trainer worker trainer-0 refuses this run's settings: sharding: run 'full', worker 'none'"),
        (RemoteUserError("reward", "unknown_endpoint", "no endpoint 'x'"), 2, "reward tier replied"),
        (CheckpointNotFound("/x", "it has no controller_state.json"), 2, "cannot resume from '/x'"),
        (TierDied("trainer", "trainer-0", 1, error="RuntimeError: x"), 1, "trainer worker trainer-0 exited"),
    ],
)  # fmt: skip
def test_user_errors_exit_2_and_failures_exit_1_with_one_line(
    error: Exception,
    code: int,
    needle: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def train(job: object) -> int:
        raise error

    monkeypatch.setattr(cli, "train", train)
    assert cli.main(["train", str(TINY)]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_crash_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def train(job: object) -> int:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "train", train)
    with pytest.raises(ZeroDivisionError):  # uncaught: Python prints the traceback and exits 1
        cli.main(["train", str(TINY)])
