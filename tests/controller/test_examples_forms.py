"""Every example job loads in its nested form, and in the previous release's flat form to the same
config, with a FutureWarning naming the keys that are not short forms (issue 28 point 2)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from rlfleet.common.schema.config import flatten, load_config
from rlfleet.controller.config import JobConfig, TrainerConfig

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_loads_nested_and_flat_alike(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the nested form warns about nothing
        nested = load_config(JobConfig, path)
    flat = flatten(JobConfig, yaml.safe_load(path.read_text()))
    assert not {"update", "batch", "placement", "eval", "algorithm"} & {
        key for key, value in flat.items() if isinstance(value, dict)
    }, flat
    deprecated = sorted(set(flat) - set(JobConfig.model_fields) - TrainerConfig.SHORT)
    if deprecated:
        with pytest.warns(FutureWarning, match="flat form is deprecated") as caught:
            loaded = load_config(JobConfig, data=flat)
        said = " ".join(str(w.message) for w in caught)
        assert all(f"{key} -> " in said for key in deprecated), (deprecated, said)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loaded = load_config(JobConfig, data=flat)
    assert loaded == nested


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 8
