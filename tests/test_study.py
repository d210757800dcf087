"""The training study end to end on the toy target with budgets of seconds: every variant trained for the
same budget, results.json / table.md / curves.png written, each variant and the study logged to W&B, a
rerun keeping the finished variants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle_tree.data.toy import default_cache_dir
from eagle_tree.training.study import StudyConfig, run_study, study_table
from eagle_tree.utils.config import ConfigError, load_config
from tests.wandb_records import read_run

ROOT = Path(__file__).resolve().parents[1]
TOY_CACHE = str(default_cache_dir())


def _study(out: Path, **kw) -> StudyConfig:
    common = [f"target.toy_cache_dir={TOY_CACHE}", "eval.num_prompts=2", "eval.max_new_tokens=10",
              "eval.copy_prompts=toy", "eval.copy_num_prompts=2", "eval.copy_max_new_tokens=10",
              "eval.tree_depth=3", "eval.tree_top_k=2", "eval.tree_total_tokens=6"]
    return load_config(StudyConfig, None, [
        f"output_dir={out}", "name=toy-study", f"base={ROOT / 'configs' / 'smoke.yaml'}", "minutes=0.04",
        "eval_every_minutes=0.02", "threads=1", f"common={json.dumps(common)}",
        'variants={"random": [], "target-init": ["model.init=target"]}', *kw.pop("extra", [])])


@pytest.mark.slow
def test_study_trains_every_variant_for_the_same_budget_and_reports(tmp_path, monkeypatch, capsys):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    out = tmp_path / "study"
    results = run_study(_study(out))
    assert set(results["variants"]) == {"random", "target-init"}
    for name, v in results["variants"].items():
        assert v["budget"]["max_minutes"] == 0.04 and v["steps"] == v["budget"]["resolved_steps"]
        minutes = [p["minutes"] for p in v["points"]]
        assert minutes[0] == 0.0 and minutes == sorted(minutes) and len(minutes) >= 3  # start, >= 1 by time, end
        for p in v["points"]:
            assert p["acceptance_length_chain"] >= 1.0 and p["acceptance_length_copy_chain"] >= 1.0
            assert 0.0 <= p["acc_0"] <= 1.0
        assert (out / name / "final" / "model.safetensors").is_file()
    table = (out / "table.md").read_text()
    assert "| random | (base) |" in table and "| target-init | `model.init=target` |" in table
    assert table.strip() == study_table(results)
    assert (out / "curves.png").stat().st_size > 5000
    assert json.loads((out / "results.json").read_text())["variants"].keys() == results["variants"].keys()
    runs = [read_run(p) for p in (tmp_path / "wandb").glob("offline-run-*")]
    by_type = sorted(r.job_type for r in runs)
    assert by_type == ["study", "train", "train"]
    study_run = next(r for r in runs if r.job_type == "study")
    final = results["variants"]["target-init"]["points"][-1]
    assert study_run.summary["study/target-init/acceptance_length_copy_chain"] == pytest.approx(
        final["acceptance_length_copy_chain"])
    # a rerun keeps the finished variants (same resolved config) and trains only a changed one
    capsys.readouterr()
    again = run_study(_study(out, extra=['variants={"random": [], "target-init": ["model.init=target", '
                                          '"optim.lr=1e-3"]}']))
    printed = capsys.readouterr().out
    assert "random: kept" in printed and "target-init: training" in printed
    assert again["variants"]["random"] == results["variants"]["random"]


def test_study_config_refusals(tmp_path):
    with pytest.raises(ConfigError, match="only names unknown variant"):
        load_config(StudyConfig, None, ["only=[nope]"])
    with pytest.raises(ConfigError, match="cannot name a folder"):
        load_config(StudyConfig, None, ['variants={"a/b": []}'])
    from eagle_tree.training.study import variant_config

    study = load_config(StudyConfig, ROOT / "configs" / "study-reference.yaml", [])
    for name in study.variants:  # every variant of the reference study resolves to a valid training config
        cfg = variant_config(study, name)
        assert cfg.schedule.max_minutes == study.minutes and cfg.eval.copy_prompts == "code"


def test_features_only_builds_every_variants_cache_with_one_forward_per_example(tmp_path, monkeypatch):
    import eagle_tree.training.feature_cache as fc
    from eagle_tree.training.feature_cache import FeatureCache

    calls = []
    real = fc.example_targets
    monkeypatch.setattr(fc, "example_targets", lambda t, ids: calls.append(1) or real(t, ids))
    variants = {"small": ["data.draft_vocab_size=16", f"features.cache_dir={tmp_path / 'c16'}"],
                "large": ["data.draft_vocab_size=32", f"features.cache_dir={tmp_path / 'c32'}"],
                "same": ["optim.lr=1e-4", f"features.cache_dir={tmp_path / 'c16'}", "data.draft_vocab_size=16"]}
    common = ["features.source=cache", "features.examples_per_shard=64", "data.max_length=24",
              f"target.toy_cache_dir={TOY_CACHE}"]
    study = _study(tmp_path / "study", extra=["features_only=true", f"variants={json.dumps(variants)}",
                                             f"common={json.dumps(common)}"])
    assert run_study(study)["variants"] == {}
    small, large = FeatureCache(tmp_path / "c16"), FeatureCache(tmp_path / "c32")
    assert len(small.draft_ids) == 16 and len(large.draft_ids) == 32
    assert not small.missing_shards() and not large.missing_shards() and len(small) == len(large) > 0
    assert len(calls) == len(small)  # two caches (three variants), one target forward per example
    assert not (tmp_path / "study" / "small" / "final").exists()  # nothing trained
    import eagle_tree.training.resolve as resolve

    monkeypatch.setattr(resolve, "load_target", lambda *a: pytest.fail("complete caches need no target"))
    assert run_study(study)["variants"] == {}  # a rerun finds the caches complete and loads nothing


@pytest.mark.slow
def test_a_warm_started_variants_cache_keeps_its_heads_draft_vocabulary(tmp_path):
    """The cache built ahead of a study holds the vocabulary the variant will train with: a warm start's
    own, never one rebuilt from the data at data.draft_vocab_size (the mistake would make every cached
    target distribution the wrong width for the head)."""
    import torch

    import eagle_tree as et
    from eagle_tree.data.toy import build_toy
    from eagle_tree.training.feature_cache import FeatureCache

    target = et.TargetModel.from_pretrained(build_toy(cache_dir=TOY_CACHE).target)
    ids = torch.arange(3, 3 + 2 * 20, 2)  # 20 ids the data's frequencies would never pick in this order
    et.Eagle3DraftModel.from_target(target, draft_vocab=ids, layers=target.feature_layers).save_pretrained(
        tmp_path / "warm")
    variants = {"warm": [f"model.init_from={tmp_path / 'warm'}", f"features.cache_dir={tmp_path / 'cw'}"],
                "fresh": [f"features.cache_dir={tmp_path / 'cf'}"]}
    common = ["features.source=cache", "features.examples_per_shard=64", "data.max_length=24",
              "data.draft_vocab_size=16", f"target.toy_cache_dir={TOY_CACHE}"]
    study = _study(tmp_path / "study", extra=["features_only=true", f"variants={json.dumps(variants)}",
                                             f"common={json.dumps(common)}"])
    run_study(study)
    assert torch.equal(FeatureCache(tmp_path / "cw").draft_ids.cpu(), ids)
    assert len(FeatureCache(tmp_path / "cf").draft_ids) == 16  # the negative control: built from the data


def test_the_smollm2_study_gives_each_draft_vocabulary_its_own_cache():
    from eagle_tree.training.study import variant_config

    study = load_config(StudyConfig, ROOT / "configs" / "study-smollm2.yaml", [])
    cfgs = {name: variant_config(study, name) for name in study.variants}
    by_cache: dict[str, set[int]] = {}
    for cfg in cfgs.values():
        assert cfg.features.source == "cache" and cfg.schedule.max_minutes == study.minutes
        assert "tuning" in cfg.eval.prompts  # evaluated on our own tuning prompts, never MT-bench
        by_cache.setdefault(cfg.features.cache_dir, set()).add(cfg.data.draft_vocab_size)
    assert all(len(sizes) == 1 for sizes in by_cache.values())  # a cache serves one vocabulary
    assert sorted(s for sizes in by_cache.values() for s in sizes) == [8192, 16384, 32768]


def test_curves_plot_says_when_a_metric_was_not_measured(tmp_path, monkeypatch):
    import matplotlib.figure

    from eagle_tree.training.study import curves_plot

    seen = {}

    def record(fig, path, **kwargs):
        seen.update({ax.get_title(): [t.get_text() for t in ax.texts] for ax in fig.axes})
        seen["lines"] = {ax.get_title(): len(ax.lines) for ax in fig.axes}

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    point = {"minutes": 0.0, "acceptance_length_chain": 1.5, "acceptance_length_tree": 2.0, "acc_0": 0.4}
    results = {"study": {"name": "s", "minutes": 1.0}, "variants": {"a": {"points": [point]}}}
    curves_plot(results, tmp_path / "c.png")
    assert seen["copying chain"] == ["not measured in this study"]
    assert seen["held-out chain"] == [] and seen["lines"]["held-out chain"] == 1
    # with the metric present the panel draws it and says nothing
    results["variants"]["a"]["points"][0]["acceptance_length_copy_chain"] = 1.2
    curves_plot(results, tmp_path / "c.png")
    assert seen["copying chain"] == [] and seen["lines"]["copying chain"] == 1
