"""`eagle-tree decode` end to end on a tiny target saved to disk, W&B offline, read back."""

import json

import pytest
import torch

import eagle_tree as et
from eagle_tree.commands.decode import main
from eagle_tree.data.tiny import char_tokenizer, tiny_causal_lm
from eagle_tree.utils.prompts import PromptError, read_prompts
from tests.wandb_records import read_run


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode")
    tok = char_tokenizer()
    hf = tiny_causal_lm("llama", vocab_size=len(tok), num_layers=6)
    hf.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    et.Eagle3DraftModel.from_target(hf).save_pretrained(root / "head")
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n"]))
    return root


@pytest.mark.parametrize("mode", ["tree", "chain", "plain"])
def test_decode_command_prints_and_logs(model_dirs, tmp_path, monkeypatch, capsys, mode):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    args = [f"target={model_dirs / 'target'}", f"head={model_dirs / 'head'}", f"prompts={model_dirs / 'prompts.jsonl'}",
            f"mode={mode}", "max_new_tokens=12", "tree.depth=3", "tree.top_k=2", "tree.total_tokens=6",
            f"output={tmp_path / 'out.json'}"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "acceptance length (tokens per round)" in printed
    result = json.loads((tmp_path / "out.json").read_text())
    assert len(result["prompts"]) == 2
    lengths = [n for p in result["prompts"] for n in p["acceptance_lengths"]]
    assert sum(lengths) == result["summary"]["tokens"] - 2  # the first token of each prompt comes from prefill
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run = read_run(runs[0])
    logged = [row["decode/acceptance_length"] for row in run.history if "decode/acceptance_length" in row]
    assert logged == lengths
    assert run.summary["decode/acceptance_length"] == pytest.approx(result["summary"]["acceptance_length"])
    assert "decode/acceptance_length_hist" in run.keys()


def test_greedy_decode_equals_plain(model_dirs, tmp_path):
    outs = {}
    for mode in ("tree", "plain"):
        args = [f"target={model_dirs / 'target'}", f"head={model_dirs / 'head'}", f"mode={mode}",
                f"prompts={model_dirs / 'prompts.jsonl'}", "max_new_tokens=10", "wandb.mode=disabled",
                f"output={tmp_path / mode}.json"]
        assert main(args) == 0
        outs[mode] = [p["continuation"] for p in json.loads((tmp_path / f"{mode}.json").read_text())["prompts"]]
    assert outs["tree"] == outs["plain"]


def test_prompt_file_errors(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"text": "x"}))
    with pytest.raises(ValueError, match="expected a 'prompt' field"):
        read_prompts(bad)
    with pytest.raises(PromptError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")


def test_plain_mode_needs_no_head_but_tree_does(model_dirs, capsys):
    assert main([f"target={model_dirs / 'target'}", "head=null", "mode=tree", "prompt=x", "wandb.mode=disabled"]) == 2
    assert "needs a draft head" in capsys.readouterr().err
    assert torch.is_grad_enabled()


def test_default_mode_decodes_with_the_head_folders_decoding_json(model_dirs, tmp_path, capsys):
    """mode=default: the shapes of the head's decoding.json (here a chain with context branches); greedy
    output still equals plain; a head folder without the file is refused with the fix."""
    import shutil

    from eagle_tree.decoding.context import ContextConfig
    from eagle_tree.decoding.shapes import save_decoding_defaults

    head = tmp_path / "head"
    shutil.copytree(model_dirs / "head", head)
    common = [f"target={model_dirs / 'target'}", f"prompts={model_dirs / 'prompts.jsonl'}", "max_new_tokens=10",
              "wandb.mode=disabled"]
    assert main([*common, f"head={head}", "mode=default"]) == 2
    assert "holds no decoding.json" in capsys.readouterr().err
    tree = et.TreeConfig(depth=2, top_k=1, total_tokens=2, context=ContextConfig(lookup_tokens=4))
    save_decoding_defaults(head, tree, greedy=True)
    outs = {}
    for mode in ("default", "plain"):
        assert main([*common, f"head={head}", f"mode={mode}", f"output={tmp_path / mode}.json"]) == 0
        outs[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    texts = {mode: [p["continuation"] for p in out["prompts"]] for mode, out in outs.items()}
    assert texts["default"] == texts["plain"]
    assert outs["default"]["summary"]["method"] == "default" and outs["default"]["summary"]["acceptance_length"] > 1.0
