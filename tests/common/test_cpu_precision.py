"""``mixed_precision: auto`` on a CPU: bf16 only where the CPU computes it natively."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema import trainer
from rlfleet.common.schema.trainer import CPU_BF16_ENV, cpu_has_native_bf16, resolve_precision

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu vme sse2 avx avx2 fma\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"


@pytest.mark.parametrize(
    ("text", "native"), [(AVX2_ONLY, False), (SAPPHIRE, True), ("processor : 0\n", False)]
)
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path: Path, text: str, native: bool) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    assert cpu_has_native_bf16(info) is native


def test_an_unreadable_cpuinfo_counts_as_no_bf16(tmp_path: Path) -> None:
    assert cpu_has_native_bf16(tmp_path / "absent") is False


@pytest.mark.parametrize("native", [False, True])
def test_auto_follows_the_cpu_and_explicit_settings_stay(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)  # the suite pins it (tests/conftest.py)
    monkeypatch.setattr(trainer, "cpu_has_native_bf16", lambda: native)
    assert resolve_precision("auto", "cpu") == ("bf16" if native else "none")
    assert resolve_precision("auto", "cuda:0") == "bf16"
    assert resolve_precision("bf16", "cpu") == "bf16"
    assert resolve_precision("none", "cuda") == "none"


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize(("value", "expected"), [("0", "none"), ("1", "bf16"), (" ", None)])
def test_the_environment_overrides_the_cpu_check_for_auto_only(
    monkeypatch: pytest.MonkeyPatch, native: bool, value: str, expected: str | None
) -> None:
    monkeypatch.setenv(CPU_BF16_ENV, value)
    monkeypatch.setattr(trainer, "cpu_has_native_bf16", lambda: native)
    assert resolve_precision("auto", "cpu") == (expected or ("bf16" if native else "none"))
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("none", "cpu") == "none"
    assert resolve_precision("bf16", "cpu") == "bf16"


@pytest.mark.parametrize("value", ["yes", "2", "bf16"])
def test_a_malformed_override_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(CPU_BF16_ENV, value)
    with pytest.raises(ConfigError, match=f"'mixed_precision'.*{CPU_BF16_ENV} must be 0 or 1.*{value!r}"):
        resolve_precision("auto", "cpu")
    assert resolve_precision("none", "cpu") == "none"  # only auto reads it
