"""Every YAML file in configs/ loads against its command's schema (a new config without a schema fails)."""

from pathlib import Path

import pytest

from eagle_tree.commands.bench import BenchConfig
from eagle_tree.commands.bench_serving import ServingBenchConfig
from eagle_tree.commands.decode import DecodeConfig
from eagle_tree.reference.chat_data import ChatDataConfig
from eagle_tree.training.config import TrainConfig
from eagle_tree.training.study import StudyConfig
from eagle_tree.utils.config import ConfigError, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
SCHEMAS = {"bench-serving": ServingBenchConfig,  # before "bench-": the first matching prefix decides
           "bench-": BenchConfig, "decode-": DecodeConfig, "train-": TrainConfig, "smoke": TrainConfig,
           "study-": StudyConfig, "chat-data-": ChatDataConfig}


def schema_for(path: Path):
    for prefix, schema in SCHEMAS.items():
        if path.name.startswith(prefix):
            return schema
    raise AssertionError(f"{path.name}: no schema known for this config; add its prefix to SCHEMAS")


def test_there_are_configs():
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = load_config(schema_for(path), path)
    assert cfg is not None


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_rejects_unknown_key(path):
    with pytest.raises(ConfigError, match="did you mean"):
        load_config(schema_for(path), path, ["seedd=1"])
