"""`eagle-tree quickstart` end to end on the toy target (the reference target is exercised by the README command)."""

import json

import pytest

from eagle_tree.commands.quickstart import main
from eagle_tree.reference.toy import build_toy
from eagle_tree.utils.wandb_records import read_run


@pytest.mark.slow
def test_quickstart_writes_summary_plot_head_and_wandb(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    toy = build_toy(verbose=False)
    out = tmp_path / "qs"
    code = main([f"output_dir={out}", f"target={toy.target}", "data=toy", f"prompts={toy.prompts_file}",
                 "train_steps=60", "num_prompts=3", "max_new_tokens=16", "threads=1",
                 "train_overrides=[data.draft_vocab_size=48, data.max_length=128]",
                 "tree.depth=4", "tree.top_k=3", "tree.total_tokens=9"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| method | shape | temperature |" in printed
    rows = json.loads((out / "summary.json").read_text())
    assert {(r["method"], r["temperature"]) for r in rows} == {(m, t) for m in ("plain", "chain", "tree")
                                                             for t in (0.0, 1.0)}
    for r in rows:
        assert r["acceptance_length"] >= 1.0 and r["time_per_output_token_s"] > 0
        if r["temperature"] == 0.0:
            assert r["outputs_match_plain"] is True
    shapes = {(r["method"], r["temperature"]): r["shape"] for r in rows}
    assert shapes[("tree", 0.0)] == "tree-d4k3n9" and shapes[("chain", 0.0)] == "chain-4"
    # at temperature 1 the drafts are sampled from the head (sampled_drafts, on by default)
    assert shapes[("tree", 1.0)] == "tree-d3k2n10-sampled" and shapes[("chain", 1.0)] == "chain-4-sampled"
    greedy_tree = next(r for r in rows if r["method"] == "tree" and r["temperature"] == 0.0)
    assert greedy_tree["acceptance_length"] > 1.3  # the toy target is predictable: a trained head is accepted
    assert (out / "survival.png").stat().st_size > 1000
    assert (out / "head" / "config.json").is_file() and (out / "head" / "model.safetensors").is_file()
    runs = {read_run(p).job_type: read_run(p) for p in (tmp_path / "wandb").glob("offline-run-*")}
    assert "quickstart" in runs and "train" in {k for k in runs if k}
    summary = runs["quickstart"].summary
    assert summary["quickstart/tree_T0/acceptance_length"] == pytest.approx(greedy_tree["acceptance_length"])
