"""Config loading: YAML and TOML files, dotted overrides, and errors that name field and value."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.config import ConfigModel, dump_config, load_config, parse_override


class Optim(ConfigModel):
    """Optimizer settings."""

    lr: float = Field(default=1e-6, description="learning rate")
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999], description="Adam betas")


class Trainer(ConfigModel):
    """Trainer settings."""

    steps: int = Field(default=10, description="optimizer steps")
    optim: Optim = Field(default_factory=Optim, description="optimizer")
    clip: float | None = Field(default=None, description="grad clip, None for off")


class Top(ConfigModel):
    """A config with nesting."""

    name: str = Field(default="run", description="run name")
    debug: bool = Field(default=False, description="debug mode")
    trainer: Trainer = Field(default_factory=Trainer, description="trainer")
    tags: dict[str, str] = Field(default_factory=dict, description="free-form tags")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_without_any_source() -> None:
    assert load_config(Top) == Top()


def test_yaml_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "c.yaml", "name: a\ntrainer:\n  steps: 5\n  optim:\n    lr: 1e-5\n")
    cfg = load_config(Top, path)
    assert (cfg.name, cfg.trainer.steps, cfg.trainer.optim.lr) == ("a", 5, 1e-5)
    assert cfg.trainer.optim.betas == [0.9, 0.999]


def test_toml_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "c.toml", 'name = "b"\n[trainer]\nsteps = 7\n[trainer.optim]\nlr = 3e-4\n')
    cfg = load_config(Top, str(path))
    assert (cfg.name, cfg.trainer.steps, cfg.trainer.optim.lr) == ("b", 7, 3e-4)


def test_empty_yaml_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(Top, _write(tmp_path, "e.yml", "")) == Top()


@pytest.mark.parametrize(
    ("override", "check"),
    [
        ("trainer.steps=3", lambda c: c.trainer.steps == 3),
        ("trainer.optim.lr=0.1", lambda c: c.trainer.optim.lr == 0.1),
        ("trainer.optim.lr=1e-5", lambda c: c.trainer.optim.lr == 1e-5),
        ("debug=true", lambda c: c.debug is True),
        ("trainer.optim.betas=[0.5, 0.6]", lambda c: c.trainer.optim.betas == [0.5, 0.6]),
        ("trainer.clip=null", lambda c: c.trainer.clip is None),
        ("trainer.clip=1.5", lambda c: c.trainer.clip == 1.5),
        ("tags.team=a", lambda c: c.tags == {"team": "a"}),
        ("name=", lambda c: c.name == ""),
        ("name=a=b", lambda c: c.name == "a=b"),
    ],
)
def test_overrides(override: str, check: object) -> None:
    cfg = load_config(Top, overrides=[override])
    assert check(cfg)  # type: ignore[operator]


def test_layers_apply_in_order_data_file_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, "c.yaml", "trainer:\n  steps: 5\n")
    cfg = load_config(
        Top, path, ["trainer.optim.lr=0.5"], data={"name": "from-data", "trainer": {"steps": 1, "clip": 2.0}}
    )
    assert (cfg.name, cfg.trainer.steps, cfg.trainer.clip, cfg.trainer.optim.lr) == ("from-data", 5, 2.0, 0.5)


def test_data_is_not_mutated() -> None:
    data = {"trainer": {"steps": 1}}
    load_config(Top, overrides=["trainer.steps=9"], data=data)
    assert data == {"trainer": {"steps": 1}}


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(Top, overrides=["trainer.optim.lr=1e-5", "tags.x=y", "trainer.clip=1.0"])
    path = _write(tmp_path, "resolved.yaml", dump_config(cfg))
    assert load_config(Top, path) == cfg
    assert dump_config(cfg).startswith("name: run\n")


def test_config_model_validates_assignment() -> None:
    cfg = Top()
    with pytest.raises(ValueError, match="steps"):
        cfg.trainer.steps = "many"  # type: ignore[assignment]


def _error(**kwargs: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(Top, **kwargs)  # type: ignore[arg-type]
    return info.value


def test_unknown_field_names_path_value_and_suggests(tmp_path: Path) -> None:
    err = _error(overrides=["trainer.optim.lrr=0.1"])
    assert (err.path, err.value) == ("trainer.optim.lrr", 0.1)
    assert "unknown field" in str(err) and "did you mean 'lr'" in str(err)


def test_wrong_type_names_path_and_value(tmp_path: Path) -> None:
    err = _error(path=_write(tmp_path, "c.yaml", "trainer:\n  steps: lots\n"))
    assert (err.path, err.value) == ("trainer.steps", "lots")
    assert "trainer.steps" in str(err) and "'lots'" in str(err)


def test_list_item_path_is_indexed() -> None:
    err = _error(overrides=["trainer.optim.betas=[0.9, x]"])
    assert (err.path, err.value) == ("trainer.optim.betas[1]", "x")


def test_several_errors_are_counted() -> None:
    err = _error(overrides=["trainer.steps=x", "debug=maybe"])
    assert "1 more problem" in str(err)


def test_missing_file_names_it(tmp_path: Path) -> None:
    err = _error(path=tmp_path / "nope.yaml")
    assert err.value == str(tmp_path / "nope.yaml") and "no such config file" in str(err)


def test_unknown_suffix(tmp_path: Path) -> None:
    err = _error(path=_write(tmp_path, "c.json", "{}"))
    assert ".toml" in err.reason and err.value.endswith("c.json")  # type: ignore[union-attr]


def test_malformed_yaml_names_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "c.yaml", "name: a\ntrainer: [1, 2\nother: 3\n")
    err = _error(path=path)
    assert err.path.startswith(f"{path}:") and "malformed YAML" in err.reason
    assert int(err.path.rsplit(":", 1)[1]) >= 2


def test_malformed_toml_names_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "c.toml", 'name = "a"\ntrainer = = 3\n')
    err = _error(path=path)
    assert (err.path, err.value) == (f"{path}:2", "trainer = = 3") and "malformed TOML" in err.reason


def test_top_level_must_be_mapping(tmp_path: Path) -> None:
    err = _error(path=_write(tmp_path, "c.yaml", "- 1\n- 2\n"))
    assert "mapping" in err.reason and "list" in err.reason


@pytest.mark.parametrize(
    ("override", "path", "fragment"),
    [
        (["trainer.steps"], "<override>", "KEY=VALUE"),
        (["trainer..steps=1"], "<override>", "dot-separated"),
        (["trainer.optim.betas=[1, 2"], "trainer.optim.betas", "not a YAML value"),
        (["name=x", "name.first=a"], "name", "not a table"),
    ],
)
def test_bad_overrides(override: list[str], path: str, fragment: str) -> None:
    err = _error(overrides=override)
    assert err.path == path and fragment in err.reason


def test_a_bare_string_is_not_a_list_of_overrides() -> None:
    with pytest.raises(TypeError):
        load_config(Top, overrides="trainer.steps=3")


def test_parse_override_reads_yaml_scalars() -> None:
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("x=off") == (["x"], False)
    assert parse_override(" k = 'quoted' ") == (["k"], "quoted")
