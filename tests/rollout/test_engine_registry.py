"""The engine registry and factory, and HFEngine's constructor checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.errors import ConfigError
from rlfleet.rollout.engines import ENGINES, Engine, HFEngine, make_engine
from rlfleet.rollout.errors import UnknownEngine


@pytest.mark.timeout(60)
def test_make_engine_builds_a_protocol_engine(tiny_checkpoint: Path) -> None:
    engine = make_engine("hf", tiny_checkpoint, seed=3, max_batch_size=4, model_id="tiny")
    assert isinstance(engine, HFEngine)
    assert isinstance(engine, Engine)
    assert engine.model_id == "tiny" and engine.weight_version == 0
    assert ENGINES["hf"] is HFEngine


@pytest.mark.timeout(30)
def test_unknown_engine_names_the_registered_ones(tiny_checkpoint: Path) -> None:
    with pytest.raises(UnknownEngine, match="'sglang'.*registered engines: hf"):
        make_engine("sglang", tiny_checkpoint)


@pytest.mark.timeout(30)
def test_constructor_validates_settings(tiny_checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="dtype"):
        HFEngine(tiny_checkpoint, dtype="float8")
    with pytest.raises(ConfigError, match="max_batch_size"):
        HFEngine(tiny_checkpoint, max_batch_size=0)
