"""`eagle-tree regenerate`: the target continues dataset rows; batches are seeded and resumable."""

from __future__ import annotations

import json

import pytest
import torch

from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.reference.regenerate import RegenerateConfig, make_jobs, regenerate
from tests.test_data import make_tokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog " * 2, "Hello! How can I help?", "", "Tell me a joke",
         "system user assistant", "Hi there", "No."]


@pytest.fixture(scope="module")
def model_and_tok():
    tok = make_tokenizer("char")
    model = tiny_causal_lm("llama", vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                           intermediate_size=64, initializer_range=0.5, seed=0).eval()
    return model, tok


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _read(path):
    return [json.loads(line) for line in open(path)]


def test_text_rows_keep_the_prefix_and_add_the_continuation(tmp_path, model_and_tok):
    model, tok = model_and_tok
    data = _write(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    cfg = RegenerateConfig(data=data, output=str(tmp_path / "out.jsonl"), prefix_tokens=6, max_new_tokens=5,
                           temperatures=[0.0, 1.0], batch_size=2)
    result = regenerate(cfg, model=model, tokenizer=tok, progress=False)
    rows = _read(tmp_path / "out.jsonl")
    assert result["rows"] == len(rows) == len(TEXTS) - 1  # the empty text has nothing to continue
    assert not (tmp_path / "out.jsonl.partial").exists()
    for row in rows:
        source = TEXTS[row["source_index"]]
        prefix = tok.decode(tok(source)["input_ids"][:6], skip_special_tokens=True)
        assert row["text"].startswith(prefix) and 0 < row["generated_tokens"] <= 5
        assert row["temperature"] == [0.0, 1.0][row["source_index"] % 2]
    # greedy rows are the target's own greedy continuation of the prefix
    greedy = next(r for r in rows if r["temperature"] == 0.0)
    ids = torch.tensor([tok(TEXTS[greedy["source_index"]])["input_ids"][:6]])
    expect = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)[0, 6:]
    assert greedy["text"] == tok.decode(ids[0], skip_special_tokens=True) + tok.decode(expect, skip_special_tokens=True)


class _Killed(Exception):
    pass


class _DiesAfter:
    """The target, killed when it starts batch ``n + 1``."""

    def __init__(self, model, n: int):
        self.model, self.left = model, n

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def generate(self, **kwargs):
        if self.left == 0:
            raise _Killed
        self.left -= 1
        return self.model.generate(**kwargs)


def test_interrupted_run_resumes_to_the_same_file(tmp_path, model_and_tok):
    model, tok = model_and_tok
    data = _write(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    common = dict(data=data, prefix_tokens=4, max_new_tokens=6, temperatures=[1.0], batch_size=2, seed=3)
    whole = RegenerateConfig(output=str(tmp_path / "whole.jsonl"), **common)
    regenerate(whole, model=model, tokenizer=tok, progress=False)

    cut = RegenerateConfig(output=str(tmp_path / "cut.jsonl"), **common)
    with pytest.raises(_Killed):
        regenerate(cut, model=_DiesAfter(model, 1), tokenizer=tok, progress=False)
    partial = tmp_path / "cut.jsonl.partial"
    assert not (tmp_path / "cut.jsonl").exists() and partial.is_file()
    with open(partial, "a") as f:
        f.write('{"text": "a row torn by the ki')  # killed half-way through writing the next batch
    other = RegenerateConfig(output=str(tmp_path / "cut.jsonl"), **(common | {"seed": 4}))
    with pytest.raises(ValueError, match="other settings"):  # never mixed with rows of other settings
        regenerate(other, model=model, tokenizer=tok, progress=False)
    result = regenerate(cut, model=model, tokenizer=tok, progress=False)
    assert result["resumed_batches"] == 1
    assert (tmp_path / "cut.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()


def test_every_takes_a_spread_out_subset(tmp_path, model_and_tok):
    model, tok = model_and_tok
    data = _write(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    cfg = RegenerateConfig(data=data, output=str(tmp_path / "out.jsonl"), every=3, max_new_tokens=2)
    regenerate(cfg, model=model, tokenizer=tok, progress=False)
    assert [r["source_index"] for r in _read(tmp_path / "out.jsonl")] == [0, 1, 2]  # input rows 0, 3, 6
    assert _read(tmp_path / "out.jsonl")[1]["text"].startswith("Tell me")


def test_a_different_seed_samples_differently(tmp_path, model_and_tok):
    """The negative control for the resume test: sampled rows depend on the seed."""
    model, tok = model_and_tok
    data = _write(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    outs = []
    for seed in (0, 1):
        cfg = RegenerateConfig(data=data, output=str(tmp_path / f"s{seed}.jsonl"), prefix_tokens=4, max_new_tokens=8,
                               temperatures=[1.0], batch_size=3, seed=seed)
        regenerate(cfg, model=model, tokenizer=tok, progress=False)
        outs.append((tmp_path / f"s{seed}.jsonl").read_text())
    assert outs[0] != outs[1]


def test_conversations_get_a_new_assistant_reply(tmp_path, model_and_tok):
    model, tok = model_and_tok
    rows = [{"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "old reply"}]},
            {"messages": [{"role": "assistant", "content": "no prompt"}]}]
    data = _write(tmp_path / "in.jsonl", rows)
    cfg = RegenerateConfig(data=data, output=str(tmp_path / "out.jsonl"), max_new_tokens=4)
    regenerate(cfg, model=model, tokenizer=tok, progress=False)
    out = _read(tmp_path / "out.jsonl")
    assert len(out) == 1  # a conversation without a user turn has nothing to answer
    conv = out[0]["conversations"]
    assert conv[0] == {"role": "user", "content": "Hi there"}
    assert conv[1]["role"] == "assistant" and conv[1]["content"] != "old reply" and len(conv) == 2


def test_rows_without_a_known_field_are_refused(model_and_tok):
    _, tok = model_and_tok
    with pytest.raises(ValueError, match="expected a text field"):
        make_jobs([{"body": "x"}], tok, RegenerateConfig())
    with pytest.raises(ValueError, match="temperatures"):
        RegenerateConfig(temperatures=[])


def test_conversations_need_a_chat_template(model_and_tok):
    tok = make_tokenizer("char", template=None)
    with pytest.raises(ValueError, match="chat_template"):
        make_jobs([{"conversations": [{"role": "user", "content": "x"}]}], tok, RegenerateConfig())


@pytest.mark.parametrize("output", ["folder", "out.json"])
def test_output_must_be_a_jsonl_file(tmp_path, model_and_tok, output):
    model, tok = model_and_tok
    (tmp_path / "folder").mkdir()
    cfg = RegenerateConfig(data=_write(tmp_path / "in.jsonl", [{"text": "abc"}]), output=str(tmp_path / output))
    with pytest.raises(ValueError, match="must name a .jsonl file"):
        regenerate(cfg, model=model, tokenizer=tok, progress=False)
