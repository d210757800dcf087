from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from eagle_tree.utils.checks import check_ranges
from eagle_tree.utils.config import ConfigError, config_to_dict, load_config, parse_cli, save_config


@dataclass
class Optim:
    lr: float = 1e-3
    """peak learning rate"""
    steps: int = 100
    betas: tuple[float, float] = (0.9, 0.95)

    def __post_init__(self):
        check_ranges(self, steps=1)


@dataclass
class Logging:
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto picks offline without an API key"""
    tags: list[str] = field(default_factory=list)


@dataclass
class Experiment:
    """A toy experiment config."""

    model: str
    train: Optim = field(default_factory=Optim)
    tuned: Optim = field(default_factory=lambda: Optim(lr=0.5))
    wandb: Logging = field(default_factory=Logging)
    layers: list[int] = field(default_factory=lambda: [2, 4])
    name: str | None = None
    out: Path = Path("runs")
    greedy: bool = False
    extra: dict[str, int] = field(default_factory=dict)


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_yaml_then_overrides(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"model": "tiny", "train": {"lr": 0.01, "steps": 5}})
    cfg = load_config(Experiment, path, ["train.lr=3e-4", "layers=[2,4,6]", "wandb.mode=disabled", "out=/x"])
    assert cfg.model == "tiny"
    assert cfg.train == Optim(lr=3e-4, steps=5)
    assert isinstance(cfg.train.lr, float)
    assert cfg.layers == [2, 4, 6]
    assert cfg.wandb.mode == "disabled"
    assert cfg.out == Path("/x")
    assert cfg.train.betas == (0.9, 0.95)


def test_override_value_parsing():
    overrides = ["model=7", "name=null", "train.steps=1e3", "greedy=true", "extra.k=3"]
    cfg = load_config(Experiment, None, overrides)
    assert cfg.model == "7" and cfg.name is None and cfg.train.steps == 1000 and cfg.greedy is True
    assert cfg.extra == {"k": 3}
    assert load_config(Experiment, None, ["model=m", "name=off"]).name == "off"  # not YAML's False
    assert load_config(Experiment, None, ["model=m", "train.lr=1"]).train.lr == 1.0  # int accepted
    cfg = load_config(Experiment, None, ["model=m", "train={lr: 0.5}"])  # sections merge
    assert cfg.train.lr == 0.5 and cfg.train.steps == 100


@pytest.mark.parametrize(
    "override, message",
    [
        ("trian.lr=1", "unknown config key 'trian.lr' (in an override); did you mean 'train.lr'?"),
        ("train.lrr=1", "did you mean 'train.lr'?"),
        ("wandb.mdoe=offline", "did you mean 'wandb.mode'?"),
        ("zzzzz=1", "valid keys at top level: model, train"),
        ("train.lr.x=1", "'train.lr' is a value, not a section"),
    ],
)
def test_unknown_override_keys(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(Experiment, None, ["model=m", override])
    assert message in str(info.value)


def test_unknown_yaml_keys(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"model": "m", "trian": {"lr": 1}})
    expected = r"unknown config key 'trian' \(in '.*c.yaml'\); did you mean 'train'\?"
    with pytest.raises(ConfigError, match=expected):
        load_config(Experiment, path)
    path = write_yaml(tmp_path / "c.yaml", {"model": "m", "wandb": {"tag": ["a"]}})
    with pytest.raises(ConfigError, match="unknown config key 'wandb.tag'.*did you mean 'wandb.tags'"):
        load_config(Experiment, path)


def test_literal_and_type_errors(tmp_path):
    allowed = "'auto', 'online', 'offline', 'disabled'"
    with pytest.raises(ConfigError, match=f"'wandb.mode': expected one of {allowed}, got 'sometimes'"):
        load_config(Experiment, None, ["model=m", "wandb.mode=sometimes"])
    bad = [
        ("train.steps=2.5", "'train.steps': expected int"),
        ("train.steps=true", "'train.steps': expected int"),
        ("train.lr=fast", "'train.lr': expected float, got 'fast'"),
        ("layers=[1,x]", "'layers.1': expected int"),
        ("layers=3", "'layers': expected list[int]"),
        ("train.betas=[0.9]", "'train.betas': expected 2 items"),
        ("greedy=1", "'greedy': expected true or false"),
        ("train=3", "'train' must be a mapping"),
    ]
    for override, message in bad:
        with pytest.raises(ConfigError) as info:
            load_config(Experiment, None, ["model=m", override])
        assert message in str(info.value), override
    path = write_yaml(tmp_path / "c.yaml", {"model": 12})
    with pytest.raises(ConfigError, match="'model': expected str"):
        load_config(Experiment, path)


def test_malformed_and_missing(tmp_path):
    with pytest.raises(ConfigError, match="malformed override 'train.lr': expected key=value"):
        load_config(Experiment, None, ["model=m", "train.lr"])
    with pytest.raises(ConfigError, match="missing required config key.*: model"):
        load_config(Experiment, None, [])
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(Experiment, tmp_path / "absent.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(Experiment, tmp_path / "list.yaml")


def test_save_load_round_trip(tmp_path):
    cfg = load_config(Experiment, None, ["model=m", "train.betas=[0.8,0.9]", "wandb.tags=[a,b]", "extra.n=2"])
    path = save_config(cfg, tmp_path / "sub" / "config.yaml")
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]  # no temp file left
    assert yaml.safe_load(path.read_text()) == config_to_dict(cfg)
    assert config_to_dict(cfg)["train"]["betas"] == [0.8, 0.9] and config_to_dict(cfg)["out"] == "runs"
    assert load_config(Experiment, path) == cfg


def test_parse_cli(tmp_path, capsys):
    path = write_yaml(tmp_path / "c.yaml", {"model": "tiny", "train": {"steps": 7}})
    cfg = parse_cli(Experiment, ["--config", str(path), "train.lr=0.5", "wandb.mode=offline"])
    assert (cfg.model, cfg.train.steps, cfg.train.lr, cfg.wandb.mode) == ("tiny", 7, 0.5, "offline")
    assert parse_cli(Experiment, [f"--config={path}"]).model == "tiny"
    assert parse_cli(Experiment, ["model=x"]).model == "x"

    with pytest.raises(SystemExit) as info:
        parse_cli(Experiment, ["--config", str(path), "trian.lr=1"], prog="eagle-tree train")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "eagle-tree train: error: unknown config key 'trian.lr'" in err
    assert "did you mean 'train.lr'?" in err
    for argv in (["--lr", "1"], ["--config"]):
        with pytest.raises(SystemExit):
            parse_cli(Experiment, argv)


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit) as info:
        parse_cli(Experiment, ["--help"], prog="eagle-tree train")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: eagle-tree train [--config FILE] [key=value ...]")
    assert "A toy experiment config." in out
    assert "model: str = (required)" in out
    assert "train.lr: float = 0.001" in out and "peak learning rate" in out
    assert "tuned.lr: float = 0.5" in out  # the factory's value, not the class default
    assert "wandb.mode: auto|online|offline|disabled = 'auto'" in out
    assert "auto picks offline without an API key" in out  # attribute docstring
    for name in ("train.steps", "train.betas", "wandb.tags", "layers", "name", "out", "greedy", "extra"):
        assert f"  {name}: " in out


@pytest.mark.parametrize("override", ["train.steps=0", "train.steps=-5", "tuned.steps=0"])
def test_out_of_range_values_name_their_key(override):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"config key {key} must be an integer >= 1, got -?\d"):
        load_config(Experiment, None, ["model=m", override])
