"""`eagle-tree quickstart` end to end on the toy target (the reference target is exercised by the README command)."""

import json
from pathlib import Path

import pytest

from eagle_tree.commands.quickstart import main
from eagle_tree.data.toy import build_toy
from eagle_tree.decoding.context import ContextConfig
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.shapes import save_decoding_defaults
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel
from tests.wandb_records import read_run

SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "reference" / "head"


@pytest.mark.slow
def test_quickstart_writes_summary_plot_head_and_wandb(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    toy = build_toy(verbose=False)
    out = tmp_path / "qs"
    # the reference head: another head of the toy target, with its own (deeper) feature layers
    reference = tmp_path / "reference-head"
    target = TargetModel.from_pretrained(str(toy.target), feature_layers=[1, 2, 3])
    Eagle3DraftModel.from_target(target, draft_vocab=range(40), init="target").save_pretrained(reference)
    # its default decoder (decoding.json): greedy chain-2 with context branches, sampled chain-1 at T > 0
    chain_ctx = TreeConfig(depth=2, top_k=1, total_tokens=2, context=ContextConfig(lookup_tokens=4))
    save_decoding_defaults(reference, chain_ctx, greedy=True)
    save_decoding_defaults(reference, TreeConfig.chain(1, sampled=True), greedy=False)
    code = main([f"output_dir={out}", f"target={toy.target}", "data=toy", f"prompts={toy.prompts_file}",
                 f"reference_head={reference}",
                 "train_steps=60", "num_prompts=3", "max_new_tokens=16", "threads=1",
                 "train_overrides=[data.draft_vocab_size=48, data.max_length=128]",
                 "tree.depth=4", "tree.top_k=3", "tree.total_tokens=9", "chat.enabled=false"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| method | head | shape | temperature |" in printed
    assert "| chain | fresh (this run) |" in printed and "| tree | shipped (reference) |" in printed
    assert f"shipped = {reference}" in printed
    rows = json.loads((out / "summary.json").read_text())
    assert sorted((r["method"], r["head"] or "", r["temperature"]) for r in rows) == sorted(
        [("plain", "", t) for t in (0.0, 1.0)]
        + [(m, h, t) for m in ("chain", "tree") for h in ("fresh", "shipped") for t in (0.0, 1.0)]
        + [("default", h, t) for h in ("fresh", "shipped") for t in (0.0, 1.0)])
    for r in rows:
        assert r["acceptance_length"] >= 1.0 and r["time_per_output_token_s"] > 0
        if r["temperature"] == 0.0:
            assert r["outputs_match_plain"] is True
    shapes = {(r["method"], r["temperature"]): r["shape"] for r in rows}
    assert shapes[("tree", 0.0)] == "tree-d4k3n9" and shapes[("chain", 0.0)] == "chain-4"
    # at temperature 1 the drafts are sampled from the head (sampled_drafts, on by default)
    assert shapes[("tree", 1.0)] == "tree-d3k2n10-sampled" and shapes[("chain", 1.0)] == "chain-4-sampled"
    # the shipped head's own decoder follows its decoding.json, per temperature; the fresh head drafts the same
    assert {(r["head"], r["temperature"]): r["shape"] for r in rows if r["method"] == "default"} == {
        (h, t): "chain-2+ctx4" if t == 0.0 else "chain-1-sampled" for h in ("fresh", "shipped") for t in (0.0, 1.0)}
    greedy_tree = next(r for r in rows if r["method"] == "tree" and r["temperature"] == 0.0 and r["head"] == "fresh")
    assert greedy_tree["acceptance_length"] > 1.3  # the toy target is predictable: a trained head is accepted
    assert (out / "survival.png").stat().st_size > 1000
    assert (out / "head" / "config.json").is_file() and (out / "head" / "model.safetensors").is_file()
    runs = {read_run(p).job_type: read_run(p) for p in (tmp_path / "wandb").glob("offline-run-*")}
    assert "quickstart" in runs and "train" in {k for k in runs if k}
    summary = runs["quickstart"].summary
    assert summary["quickstart/tree_T0/acceptance_length"] == pytest.approx(greedy_tree["acceptance_length"])
    shipped = next(r for r in rows if r["method"] == "chain" and r["temperature"] == 0.0 and r["head"] == "shipped")
    assert summary["quickstart/shipped_chain_T0/acceptance_length"] == pytest.approx(shipped["acceptance_length"])


def test_quickstart_refuses_a_reference_head_of_another_target_before_training(tmp_path, capsys):
    toy = build_toy(verbose=False)
    code = main([f"output_dir={tmp_path / 'qs'}", f"target={toy.target}", "data=toy", f"prompts={toy.prompts_file}",
                 f"reference_head={SHIPPED}"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"reference_head={SHIPPED}" in err and "does not belong to this target" in err
    assert not (tmp_path / "qs" / "train").exists()
