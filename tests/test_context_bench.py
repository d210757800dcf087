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


def test_decoding_defaults_hold_plain_decoding(tmp_path):
    """An entry may be none (plain decoding), read back as None: distinct from an absent entry, and the
    greedy entry still serves sampling when there is no sampling entry."""
    data = save_decoding_defaults(tmp_path, None, greedy=True, by="test")
    assert data["greedy"] == {"tree": None, "name": "none", "source": {"by": "test"}}
    assert load_decoding_defaults(tmp_path) == {"greedy": None, "sampling": None}  # one entry serves both
    chain = TreeConfig.chain(3)
    save_decoding_defaults(tmp_path, chain, greedy=False)
    assert load_decoding_defaults(tmp_path) == {"greedy": None, "sampling": chain}
    save_decoding_defaults(tmp_path, chain, greedy=True)
    save_decoding_defaults(tmp_path, None, greedy=False)
    assert load_decoding_defaults(tmp_path) == {"greedy": chain, "sampling": None}
    assert json.loads((tmp_path / "decoding.json").read_text())["sampling"]["name"] == "none"
    (tmp_path / "only").mkdir()
    save_decoding_defaults(tmp_path / "only", chain, greedy=True)
    assert load_decoding_defaults(tmp_path / "only") == {"greedy": chain, "sampling": chain}  # absent: not plain


def test_decoder_with_a_none_default_decodes_plainly(tmp_path):
    """A sampling default of none gives exactly the tokens of plain decoding (draft=None) for the same
    seed at T=1, one token a round, and batched too; the negative control, a drafted sampling default,
    commits more tokens a round and so runs fewer rounds. A greedy none leaves the decoder no tree."""
    from eagle_tree import SamplingConfig
    from eagle_tree.models.target import TargetModel

    assets = build_tiny_assets(tmp_path / "assets")
    head_dir = tmp_path / "head"
    shutil.copytree(assets["head"], head_dir)
    target = TargetModel.from_pretrained(str(assets["target"]))
    greedy_shape = TreeConfig.chain(2)
    save_decoding_defaults(head_dir, greedy_shape, greedy=True)
    save_decoding_defaults(head_dir, None, greedy=False)
    dec = SpeculativeDecoder(target, Eagle3DraftModel.from_pretrained(head_dir, target=target))
    t1, t0 = SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.0)
    assert dec.defaults == {"greedy": greedy_shape, "sampling": None} and dec.tree == greedy_shape
    assert dec.shape_for(t1) is None and dec.shape_for(t0) == greedy_shape
    plain = SpeculativeDecoder(target)
    prompts = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11])]
    for seed in range(3):
        out, ref = dec.generate(prompts[0], 16, sampling=t1, seed=seed), plain.generate(prompts[0], 16, sampling=t1,
                                                                                         seed=seed)
        assert torch.equal(out.sequences, ref.sequences)
        assert out.acceptance_lengths == [1] * 15 and all(r.tree_size == 0 for r in out.rounds)
    assert set(dec._kept) <= {greedy_shape}  # no drafter was built for sampling
    batch, ref = dec.generate_batch(prompts, 8, sampling=t1, seed=2), plain.generate_batch(prompts, 8, sampling=t1,
                                                                                           seed=2)
    assert all(torch.equal(a, b) for a, b in zip(batch.sequences, ref.sequences, strict=True))

    # negative control: a drafted sampling default runs the drafter, which this test can tell apart
    save_decoding_defaults(head_dir, TreeConfig.chain(3, sampled=True), greedy=False)
    drafted = SpeculativeDecoder(target, Eagle3DraftModel.from_pretrained(head_dir, target=target))
    outs = [drafted.generate(prompts[0], 16, sampling=t1, seed=seed) for seed in range(3)]
    assert all(r.tree_size == 3 for o in outs for r in o.rounds)
    assert sum(len(o.rounds) for o in outs) < 3 * 15 and max(a for o in outs for a in o.acceptance_lengths) > 1

    save_decoding_defaults(head_dir, None, greedy=True)  # greedy plain too: no tree at all
    none = SpeculativeDecoder(target, Eagle3DraftModel.from_pretrained(head_dir, target=target))
    assert none.tree is None and none.drafter is None and none.shape_for(t0) is None
    out = none.generate(prompts[1], 12, sampling=t0)
    assert torch.equal(out.sequences, plain.generate(prompts[1], 12, sampling=t0).sequences)
    assert out.acceptance_lengths == [1] * 11


def test_head_defaults_journal_key_and_shape_tell_none_apart(tmp_path):
    """method_identity (the journal key) and the report's shape column of head_defaults differ between a
    none default and a drafted one."""
    from eagle_tree import SamplingConfig
    from eagle_tree.bench.runner import HEAD_DEFAULTS, BenchModels, head_defaults_shape, method_identity
    from eagle_tree.models.target import TargetModel

    assets = build_tiny_assets(tmp_path / "assets")
    head_dir = tmp_path / "head"
    shutil.copytree(assets["head"], head_dir)
    target = TargetModel.from_pretrained(str(assets["target"]))

    def models():
        return BenchModels(target, None, head=Eagle3DraftModel.from_pretrained(head_dir, target=target))

    save_decoding_defaults(head_dir, TreeConfig.chain(2), greedy=True)
    drafted = models()
    drafted_key = method_identity(HEAD_DEFAULTS, drafted)  # reads decoding.json now
    save_decoding_defaults(head_dir, None, greedy=True)
    none = models()
    assert method_identity(HEAD_DEFAULTS, none) != drafted_key
    assert method_identity(HEAD_DEFAULTS, drafted) == drafted_key
    greedy = SamplingConfig(temperature=0.0)
    shapes = [head_defaults_shape(m.decoder(None, True), greedy) for m in (none, drafted)]
    assert shapes == ["head defaults (decoding.json): none, plain decoding", "head defaults (decoding.json): chain-2"]


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
    best = report["tuning"]["selected"]["best"]  # plain decoding is a candidate: none may win
    assert "none" in {s["name"] for s in report["tuning"]["shapes"]}
    assert (written["greedy"] is None) == (best == "none")
    assert best == "none" or written["greedy"].name == best
    assert rows["head_defaults"]["shape"] == "head defaults (decoding.json): " + (
        "none, plain decoding" if best == "none" else best)


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
