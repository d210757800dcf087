"""A tiny Llama GGUF file written with the ``gguf`` package: the stand-in for SmolLM2's Q4_1 file in tests.

:func:`write_tiny_gguf` writes what llama.cpp's converter writes for a SmolLM2-like model, at toy size:
``general.architecture = llama``, the ``llama.*`` hyperparameters, random seeded weights under GGUF
tensor names (``token_embd``, ``blk.N.attn_q``, ...; q and k rows permuted the way llama.cpp
permutes them), the attention and MLP matrices quantized to Q8_0 (so loading goes through
dequantisation), the embedding in F16 and the norms in F32; and a gpt2-style byte-level BPE in the
``tokenizer.ggml.*`` metadata with the ChatML special tokens ``<|endoftext|>`` = 0,
``<|im_start|>`` = 1 (bos), ``<|im_end|>`` = 2 (eos, padding), ``add_bos_token`` false, and
SmolLM2's chat template (a default system prompt).

It returns a :class:`TinyGGUF` holding the path and the Hugging Face state dict that loading the file
must give (the dequantised values, q / k un-permuted), so a loader can be checked weight by weight.
Writing takes about 0.1 s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2-135M-Instruct's template, character for character (its "\n" are Jinja escapes)
CHAT_TEMPLATE = (
    r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    r"{{ '<|im_start|>system\n" + SYSTEM_PROMPT + r"<|im_end|>\n' }}{% endif %}"
    r"{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# the text the BPE merges are learned from: chat words, so the golden spans are a few tokens each
CORPUS = [
    SYSTEM_PROMPT, "system", "user", "assistant",
    "What is the capital of France? The capital of France is Paris.",
    "How do I sort a list in Python? Use the sorted function, or call list.sort().",
    "Tell me a joke about the weather. Why did the cloud stay home? It was feeling under the weather.",
    "Thank you! You are welcome. Is there anything else I can help you with?",
]


@dataclass
class TinyGGUF:
    path: Path
    """The .gguf file."""
    weights: dict[str, torch.Tensor] = field(repr=False)
    """Hugging Face parameter name -> the float32 tensor loading the file must give (dequantised)."""
    vocab_size: int


def bpe_vocab(merges: int = 96) -> tuple[list[str], list[str]]:
    """(tokens by id, merges) of a byte-level BPE: the specials, the 256 byte symbols, then merged tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIALS) + len(alphabet) + merges, special_tokens=SPECIALS,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert tokens[: len(SPECIALS)] == SPECIALS and [vocab[t] for t in tokens] == list(range(len(tokens)))
    merge_list = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, merge_list


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q / k row order (rotary halves interleaved); transformers undoes it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: str | Path, *, layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 128, context: int = 256, rope_theta: float = 1e4, std: float = 0.2,
                    seed: int = 0, merges: int = 96, quantized: str = "Q8_0", tied: bool = True,
                    bos_token_id: int = 1, eos_token_id: int = 2, padding_token_id: int = 2,
                    chat_template: str | None = CHAT_TEMPLATE, name: str = "tiny-smollm") -> TinyGGUF:
    """Write the file (see the module docstring) and return it with its expected weights.

    ``quantized``: GGML type of the attention and MLP matrices ('Q8_0', 'F16' or 'F32').
    ``tied``: no ``output.weight`` (the head reuses the embedding, as in SmolLM2).
    ``bos_token_id`` / ``eos_token_id`` / ``padding_token_id``: the metadata ids, e.g. swapped to check
    that loaders follow the file rather than the token names.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, merge_list = bpe_vocab(merges)
    vocab = len(tokens)
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    qtype = Q[quantized]

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(rope_theta)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    file_type = {Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, Q.F16: gguf.LlamaFileType.MOSTLY_F16}
    w.add_file_type(int(file_type.get(qtype, gguf.LlamaFileType.ALL_F32)))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merge_list)
    w.add_bos_token_id(bos_token_id)
    w.add_eos_token_id(eos_token_id)
    w.add_pad_token_id(padding_token_id)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    expected: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str | None, value: np.ndarray, kind: Q, permute_heads: int = 0) -> None:
        """Store ``value`` (HF layout) as ``kind``; record what a loader must read back under ``hf_name``."""
        stored = _llama_cpp_permute(value, permute_heads) if permute_heads else value
        data = gguf.quants.quantize(stored, kind)
        w.add_tensor(gguf_name, data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
        if hf_name is not None:
            back = gguf.quants.dequantize(data, kind).astype(np.float32).reshape(value.shape)
            if permute_heads:  # the inverse permutation (transformers' _reverse_permute_weights)
                back = back.reshape(permute_heads, back.shape[0] // permute_heads // 2, 2, *back.shape[1:])
                back = back.swapaxes(2, 1).reshape(value.shape)
            expected[hf_name] = torch.from_numpy(np.ascontiguousarray(back))

    add("token_embd.weight", "model.embed_tokens.weight", normal(vocab, hidden), Q.F16)
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", p + "input_layernorm.weight", 1 + normal(hidden) / 4, Q.F32)
        add(b + "attn_q.weight", p + "self_attn.q_proj.weight", normal(heads * head_dim, hidden), qtype, heads)
        add(b + "attn_k.weight", p + "self_attn.k_proj.weight", normal(kv_heads * head_dim, hidden), qtype, kv_heads)
        add(b + "attn_v.weight", p + "self_attn.v_proj.weight", normal(kv_heads * head_dim, hidden), qtype)
        add(b + "attn_output.weight", p + "self_attn.o_proj.weight", normal(hidden, heads * head_dim), qtype)
        add(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + normal(hidden) / 4, Q.F32)
        add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", normal(intermediate, hidden), qtype)
        add(b + "ffn_up.weight", p + "mlp.up_proj.weight", normal(intermediate, hidden), qtype)
        add(b + "ffn_down.weight", p + "mlp.down_proj.weight", normal(hidden, intermediate), qtype)
    add("output_norm.weight", "model.norm.weight", 1 + normal(hidden) / 4, Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", normal(vocab, hidden), qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return TinyGGUF(path, expected, vocab)


# ----------------------------------------------------------------------------- fixtures
# tests/conftest.py imports them, so every module may ask for them; a module's own fixture of the same
# name (the toy target's ``model`` in a few modules) takes precedence there.


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyGGUF:
    """The tiny GGUF file, written once per test module."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def model(tiny):
    """The tiny file loaded as a causal LM through the project's one GGUF loader."""
    from eagle_tree.models.gguf import load_causal_lm

    return load_causal_lm(tiny.path)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    """The tiny file's tokenizer (with its chat template)."""
    from eagle_tree.models.gguf import load_tokenizer

    return load_tokenizer(tiny.path)
