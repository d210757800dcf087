"""Context settings in shape selection and the bench; a head folder's decoding defaults (decoding.json)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle_tree.bench.tuning import ShapeMeasurement, save_tuned_shapes, selection
from eagle_tree.commands.bench import BenchConfig, candidate_shapes, main
from eagle_tree.data.tiny import build_tiny_assets
from eagle_tree.decoding.context import ContextConfig
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.shapes import load_decoding_defaults, load_tuned_shape, save_decoding_defaults
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.utils.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CTX = ContextConfig(lookup_tokens=8)


def test_shape_names_with_context():
    assert TreeConfig.chain(4, sampled=False).name == "chain-4"
    assert TreeConfig(depth=4, top_k=1, total_tokens=4, context=CTX).name == "chain-4+ctx8"
    ctx = ContextConfig(lookup_tokens=6, branches=2, min_ngram=2, max_ngram=3, first="head")
    assert TreeConfig(depth=2, top_k=2, total_tokens=6, sampled=True, context=ctx).name == \
        "tree-d2k2n6-sampled+ctx6x2-g2to3-headfirst"


def test_tuning_with_context_selects_and_round_trips(tmp_path):
    plain = ShapeMeasurement(TreeConfig.chain(3), 0.030, 2.5)
    with_ctx = ShapeMeasurement(TreeConfig(depth=3, top_k=1, total_tokens=3, context=CTX), 0.032, 3.2)
    tree_ctx = ShapeMeasurement(TreeConfig(depth=3, top_k=2, total_tokens=6, context=CTX), 0.040, 3.3)
    chosen = selection([plain, with_ctx, tree_ctx])
    assert {k: m.name for k, m in chosen.items()} == {
        "best": "chain-3+ctx8", "chain": "chain-3+ctx8", "tree": "tree-d3k2n6+ctx8", "no_context": "chain-3",
        "context": "chain-3+ctx8", "head_only_chain": "chain-3"}  # no tree without context was measured
    path = tmp_path / "shapes.json"
    data = save_tuned_shapes(path, [plain, with_ctx, tree_ctx])
    assert set(data["marginal"]) == {"chain", "tree", "chain+ctx8", "tree+ctx8"}
    assert load_tuned_shape(path) == with_ctx.tree
    assert load_tuned_shape(path, "no_context") == plain.tree
    assert ShapeMeasurement.from_dict(with_ctx.to_dict()) == with_ctx


def test_candidate_shapes_cross_context_settings():
    cfg = BenchConfig(chain_lengths=[1, 2], trees=[TreeConfig(depth=2, top_k=2, total_tokens=4)],
                      contexts=[CTX, ContextConfig(lookup_tokens=4)])
    shapes = candidate_shapes(cfg)
    assert len(shapes) == 9 and sum(s.context is None for s in shapes) == 3


def test_decoding_defaults_round_trip(tmp_path):
    assert load_decoding_defaults(tmp_path) == {} and load_decoding_defaults(None) == {}
    greedy = TreeConfig.chain(4)
    save_decoding_defaults(tmp_path, greedy, greedy=True, by="test")
    assert load_decoding_defaults(tmp_path) == {"greedy": greedy, "sampling": greedy}  # one entry serves both
    sampled = TreeConfig(depth=2, top_k=2, total_tokens=6, sampled=True, context=CTX)
    data = save_decoding_defaults(tmp_path, sampled, greedy=False, by="test")
    assert data["greedy"]["source"] == {"by": "test"} and data["sampling"]["name"] == "tree-d2k2n6-sampled+ctx8"
    assert load_decoding_defaults(tmp_path) == {"greedy": greedy, "sampling": sampled}
    (tmp_path / "decoding.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="decoding defaults"):
        load_decoding_defaults(tmp_path)


def test_decoder_uses_the_head_folders_defaults(tmp_path):
    assets = build_tiny_assets(tmp_path / "assets")
    head_dir = tmp_path / "head"
    shutil.copytree(assets["head"], head_dir)
    from eagle_tree.models.target import TargetModel

    target = TargetModel.from_pretrained(str(assets["target"]))
    greedy, sampled = TreeConfig.chain(2, sampled=False), TreeConfig(depth=2, top_k=2, total_tokens=6, sampled=True,
                                                                     context=CTX)
    assert SpeculativeDecoder(target, Eagle3DraftModel.from_pretrained(head_dir, target=target)).tree == TreeConfig()
    save_decoding_defaults(head_dir, greedy, greedy=True)
    save_decoding_defaults(head_dir, sampled, greedy=False)
    dec = SpeculativeDecoder(target, Eagle3DraftModel.from_pretrained(head_dir, target=target))
    assert dec.tree == greedy
    from eagle_tree import SamplingConfig

    t1 = SamplingConfig(temperature=1.0)
    assert dec.shape_for(t1) == sampled and dec.shape_for(SamplingConfig(temperature=0.0)) == greedy
    out = dec.generate(torch.tensor([[5, 6, 7]]), 4, sampling=t1)
    assert dec.tree == greedy  # choosing the shape changes nothing in the decoder
    assert dec._kept[sampled].config == CTX and out.new_tokens == 4  # the sampling shape drafted
    explicit = TreeConfig.chain(3)
    assert SpeculativeDecoder(target, Eagle3DraftModel.from_pretrained(head_dir, target=target), tree=explicit).tree \
        == explicit


@pytest.mark.slow
def test_bench_with_context_methods_and_head_defaults(tmp_path):
    assets = build_tiny_assets(tmp_path / "assets")
    out = tmp_path / "out"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["--config", str(ROOT / "configs" / "bench-smoke.yaml"), f"tiny_assets={assets['target'].parent}",
                   f"output_dir={out}", "test_limit=2", "tuning_limit=2", "max_new_tokens=12", "repeats=1",
                   "chain_lengths=[1,2]", "trees=[]", "contexts=[{lookup_tokens: 3}]", "head_defaults=true",
                   "methods=[plain,hf_prompt_lookup,chain,context,head_defaults]"])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert {"context-only-ctx3", "head_defaults", "chain-2+ctx3", "hf_prompt_lookup"} <= set(rows)
    assert all(r["outputs_match_plain"] for r in rows.values())
    assert rows["context-only-ctx3"]["tree"]["context"]["lookup_tokens"] == 3
    written = load_decoding_defaults(out)
    assert written == load_decoding_defaults(assets["head"])
    assert written["greedy"].name == report["tuning"]["selected"]["best"]


def test_ooc_bench_configs_load():
    for name, temperature in (("bench-ooc.yaml", 0.0), ("bench-ooc-t1.yaml", 1.0)):
        cfg = load_config(BenchConfig, ROOT / "configs" / name)
        assert cfg.sampling.temperature == temperature
        assert cfg.test_prompts == "assets/ooc/prompts.jsonl" and cfg.contexts
        assert {"context", "hf_prompt_lookup", "hf_generate", "chain", "head_defaults"} <= set(cfg.methods)


def test_ooc_prompts_load_and_are_separate():
    from eagle_tree.utils.prompts import read_prompts

    test, tuning = read_prompts(ROOT / "assets/ooc/prompts.jsonl"), read_prompts(ROOT / "assets/ooc/tuning.jsonl")
    assert len(test) == 16 and len(tuning) == 8 and not set(test) & set(tuning)
    rows = [json.loads(line) for line in (ROOT / "assets/ooc/prompts.jsonl").read_text().splitlines()]
    build = json.loads((ROOT / "assets/ooc/build.json").read_text())
    assert {r["file"] for r in rows} <= set(build["test_files"])
    assert not set(build["test_files"]) & set(build["tuning_files"])
    assert all(128 <= r["n_tokens"] <= 300 for r in rows)


def test_training_writes_untuned_defaults_beside_the_final_head(tmp_path):
    from eagle_tree.training.loop import EvalSection, _save_untuned_decoding_defaults

    _save_untuned_decoding_defaults(tmp_path, EvalSection(tree_depth=3, tree_top_k=2, tree_total_tokens=5))
    data = json.loads((tmp_path / "decoding.json").read_text())
    assert data["greedy"]["source"] == {"by": "training", "tuned": False}
    assert load_decoding_defaults(tmp_path)["sampling"] == TreeConfig(depth=3, top_k=2, total_tokens=5)
