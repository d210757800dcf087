"""The reference-model training loop, and the shipped assets in assets/reference/ when present."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from eagle_tree.reference import builder as ref

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "reference"
SNIPPET = "import os\n\n\ndef main(path):\n    with open(path) as f:\n        return f.read().split()\n"


class _Ids:
    """Just what build_llama reads from a tokenizer."""

    bos_token_id, eos_token_id, pad_token_id = 0, 1, 2

    def __len__(self) -> int:
        return 64


def _tiny(seed: int = 0):
    spec = ref.ModelSpec(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, max_positions=64)
    return ref.build_llama(spec, _Ids(), seed=seed)


def _rows(n: int = 12, seq_len: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return list(torch.randint(3, 64, (n, seq_len), generator=g))


def test_embed_std_draws_only_the_input_embedding():
    spec = ref.ModelSpec(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, max_positions=64)
    default = ref.build_llama(spec, _Ids(), seed=0)
    wide = ref.build_llama(dataclasses.replace(spec, embed_std=1.0), _Ids(), seed=0)
    assert default.get_input_embeddings().weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert wide.get_input_embeddings().weight.std().item() == pytest.approx(1.0, rel=0.1)
    assert torch.equal(wide.lm_head.weight, default.lm_head.weight)  # everything else as before
    with pytest.raises(ValueError, match="untie"):
        ref.build_llama(dataclasses.replace(spec, embed_std=1.0, tie_embeddings=True), _Ids())


def test_lr_schedule_warms_up_then_decays():
    cfg = ref.TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert ref.lr_at(0, cfg) == pytest.approx(1e-4)
    assert ref.lr_at(9, cfg) == pytest.approx(1e-3)
    assert ref.lr_at(100, cfg) == pytest.approx(1e-4)
    lrs = [ref.lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_evaluate_loss_matches_the_model_loss():
    torch.set_num_threads(1)
    model, rows = _tiny(), _rows(4)
    expected = model(input_ids=torch.stack(rows), labels=torch.stack(rows)).loss.item()
    assert ref.evaluate_loss(model, rows, batch_size=3) == pytest.approx(expected, rel=1e-5)


def test_training_resumes_exactly_from_a_checkpoint(tmp_path):
    torch.set_num_threads(1)
    cfg = ref.TrainConfig(steps=6, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=2, eval_rows=2,
                          eval_every_s=1e9, checkpoint_every_s=1e9, seed=1)
    rows = _rows()
    straight = _tiny()
    res = ref.train_lm(straight, rows, rows[:2], cfg)
    assert res.steps == 6 and res.tokens == 6 * 4 * 16 and len(res.evals) == 1

    ckpt = tmp_path / "run.ckpt"
    first = _tiny()
    part = ref.train_lm(first, rows, rows[:2], cfg, checkpoint=ckpt, stop_after=3)
    assert part.steps == 3 and ckpt.exists() and not ckpt.with_name("run.ckpt.tmp").exists()
    resumed = _tiny(seed=123)  # different init: everything must come from the checkpoint
    ref.train_lm(resumed, rows, rows[:2], cfg, checkpoint=ckpt)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="another config"):
        ref.train_lm(_tiny(), rows, rows[:2], ref.TrainConfig(steps=7), checkpoint=ckpt)


def test_save_model_loads_back_in_float32(tmp_path):
    tok = ref.train_tokenizer([SNIPPET * 3], vocab_size=300)
    model = ref.build_llama(ref.ModelSpec(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2), tok)
    ref.save_model(model, tok, tmp_path / "m", dtype=torch.float16)
    loaded, tok2 = ref.load_model(tmp_path / "m")
    assert next(loaded.parameters()).dtype == torch.float32
    ids = tok2(SNIPPET, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model.half().float()(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- shipped assets

needs_assets = pytest.mark.skipif(not (ASSETS / "target" / "eval.json").exists(),
                                  reason="assets/reference/ not built (python train/build_reference.py)")


@needs_assets
@pytest.mark.parametrize("name,min_layers,max_layers", [("target", 8, 64), ("assistant", 1, 2)])
def test_shipped_model_loads_and_tokenizer_round_trips(name, min_layers, max_layers):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(ASSETS / name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ASSETS / name)
    assert min_layers <= model.config.num_hidden_layers <= max_layers
    ids = tok(SNIPPET, return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0], skip_special_tokens=True) == SNIPPET
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    record = json.loads((ASSETS / name / "eval.json").read_text())
    assert math.isfinite(record["test_loss"]) and record["test_loss"] < 6.0
    assert (ASSETS / name / "samples.txt").stat().st_size > 0


@needs_assets
def test_shipped_models_share_one_tokenizer_and_fit_the_size_limit():
    target = json.loads((ASSETS / "target" / "tokenizer.json").read_text())
    assistant = json.loads((ASSETS / "assistant" / "tokenizer.json").read_text())
    assert target["model"]["vocab"] == assistant["model"]["vocab"]
    total = sum(ref.folder_bytes(ASSETS / n) for n in ("target", "assistant"))
    assert total <= 25 * 1024 * 1024


@needs_assets
def test_prompts_are_held_out_by_file():
    from eagle_tree.data.corpus import Manifest

    manifest = Manifest.load(ASSETS / "manifest.json")
    train = set(manifest.paths("train"))
    for split in ("tuning", "test"):
        rows = [json.loads(line) for line in (ASSETS / "prompts" / f"{split}.jsonl").read_text().splitlines()]
        assert len(rows) == 64 and len({r["id"] for r in rows}) == 64
        assert all(set(r) >= {"id", "file", "prompt"} and r["prompt"].strip() for r in rows)
        files = {r["file"] for r in rows}
        assert files <= set(manifest.paths(split)) and not files & train


def test_build_recipe_takes_key_value_options():
    """train/build_reference.py uses the config convention of every command: key=value, ranges checked."""
    from eagle_tree.utils.config import ConfigError, load_config
    from tests.helpers import load_script

    recipe = load_script("train/build_reference.py")
    cfg = load_config(recipe.BuildConfig, None, ["target_steps=3241", "embed_std=1.0", "out=/tmp/x"])
    assert (cfg.target_steps, cfg.embed_std, cfg.out) == (3241, 1.0, "/tmp/x")
    with pytest.raises(ConfigError, match="config key batch_size must be an integer >= 1"):
        load_config(recipe.BuildConfig, None, ["batch_size=0"])
