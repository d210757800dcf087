"""Tiny randomly initialised Hugging Face causal LMs, built from configs (no hub access needed).

Used by the tests and by the smoke training config. The weights depend only on the arguments and
``seed`` (the global torch RNG is left untouched), the model is float32 and in eval mode::

    model = tiny_causal_lm("qwen3", num_layers=4)
    model = tiny_causal_lm("mistral", sliding_window=8)   # extra keywords go to the config class
"""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def _config_class(family: str):
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }
    if family not in classes:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return classes[family]


def tiny_causal_lm(
    family: str = "llama",
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
    attn_implementation: str = "eager",
    **config_kwargs,
):
    """A seeded, float32, eval-mode ``AutoModelForCausalLM`` of ``family`` (one of ``FAMILIES``).

    ``head_dim`` is ``hidden_size // num_heads`` and input/output embeddings are untied unless
    ``config_kwargs`` says otherwise; any other config field can be set through ``config_kwargs``
    (e.g. ``sliding_window=8`` for Mistral, ``initializer_range=0.1``).
    """
    from transformers import AutoModelForCausalLM

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        head_dim=hidden_size // num_heads,
        tie_word_embeddings=False,
    )
    fields.update(config_kwargs)
    config = _config_class(family)(**fields)
    with torch.random.fork_rng(devices=[]):  # seed locally, leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=torch.float32
        )
    return model.eval()


def char_tokenizer():
    """A character-level tokenizer over printable ASCII and newline (98 ids, ``<eos>`` = 1), for
    tests and toy targets that need a real tokenizer saved beside the model."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
