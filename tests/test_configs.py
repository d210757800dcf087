"""Every YAML file in configs/ loads against its command's schema (a new config without a schema fails),
keeps every value it sets, and every schema prefix names at least one config."""

from pathlib import Path

import pytest
import yaml

from eagle_tree.commands.bench import BenchConfig
from eagle_tree.commands.bench_serving import ServingBenchConfig
from eagle_tree.commands.decode import DecodeConfig
from eagle_tree.reference.chat_data import ChatDataConfig
from eagle_tree.training.config import TrainConfig
from eagle_tree.training.study import StudyConfig
from eagle_tree.utils.config import ConfigError, config_to_dict, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
SCHEMAS = {"bench-serving": ServingBenchConfig,  # before "bench-": the first matching prefix decides
           "bench-": BenchConfig, "decode-": DecodeConfig, "train-": TrainConfig, "smoke": TrainConfig,
           "study-": StudyConfig, "chat-data-": ChatDataConfig}


def schema_for(path: Path):
    for prefix, schema in SCHEMAS.items():
        if path.name.startswith(prefix):
            return schema
    raise AssertionError(f"{path.name}: no schema known for this config; add its prefix to SCHEMAS")


def test_every_schema_prefix_names_a_config():
    names = [p.name for p in CONFIGS]
    unused = [prefix for prefix in SCHEMAS if not any(name.startswith(prefix) for name in names)]
    assert not unused, f"SCHEMAS prefixes that match no file in configs/: {unused}"


def _holds(got, want) -> bool:
    """Whether the loaded value holds what the file wrote (a mapping: its keys; defaults may add others)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and _holds(got[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_holds, got, want))
    if isinstance(want, float) and isinstance(got, int | float):
        return got == pytest.approx(want)
    return got == want


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_with_the_values_it_sets(path):
    cfg = load_config(schema_for(path), path)
    assert isinstance(cfg, schema_for(path))
    resolved, written = config_to_dict(cfg), yaml.safe_load(path.read_text()) or {}
    wrong = {k: (v, resolved.get(k)) for k, v in written.items() if not _holds(resolved.get(k), v)}
    assert not wrong, f"{path.name}: (in the file, after loading) {wrong}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_rejects_unknown_key(path):
    with pytest.raises(ConfigError, match="did you mean"):
        load_config(schema_for(path), path, ["seedd=1"])
