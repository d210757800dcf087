"""Tiny randomly initialised Hugging Face causal LMs, built from configs (no hub access needed).

Used by the tests and by the smoke training config. The weights depend only on the arguments and
``seed`` (the global torch RNG is left untouched), the model is float32 and in eval mode::

    model = tiny_causal_lm("qwen3", num_layers=4)
    model = tiny_causal_lm("mistral", sliding_window=8)   # extra keywords go to the config class
"""

from __future__ import annotations

import json
from pathlib import Path

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


TINY_PROMPTS = {
    "tuning": ["def add(a, b):\n    return", "import os\nimport sys\n\n", "class Point:\n    def __init__(self",
               "for i in range(10):\n    print("],
    "test": ["def main():\n    args =", "with open(path) as f:\n    data", "if __name__ == '__main__':\n",
             "x = [i * i for i in", "while True:\n    line = input("],
}


def build_tiny_assets(folder: str | Path) -> dict[str, Path]:
    """A tiny random Llama (char tokenizer), an untrained head, the target's own weights as the
    assistant, and tuning / test prompt files, built once in ``folder`` (new or empty; a folder that
    holds anything else is refused, never cleared); returns their paths."""
    from eagle_tree.models.head import Eagle3DraftModel
    from eagle_tree.utils.atomic import atomic_dir
    from eagle_tree.utils.outputs import check_output_dir

    folder = Path(folder)
    paths = {"target": folder / "target", "head": folder / "head", "assistant": folder / "assistant",
             "tuning_prompts": folder / "tuning.jsonl", "test_prompts": folder / "test.jsonl"}
    if (folder / "COMPLETE").is_file():
        return paths
    check_output_dir(folder, "tiny_assets build", writes=[p.name for p in paths.values()],
                     replaces_folder=True, option=None)
    with atomic_dir(folder) as tmp:
        tok = char_tokenizer()
        model = tiny_causal_lm("llama", vocab_size=len(tok), num_layers=4, attn_implementation="sdpa",
                               eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=tok.unk_token_id)
        for name in ("target", "assistant"):
            model.save_pretrained(tmp / name)
            tok.save_pretrained(tmp / name)
        Eagle3DraftModel.from_target(model).save_pretrained(tmp / "head")
        for split, prompts in TINY_PROMPTS.items():
            (tmp / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        (tmp / "COMPLETE").write_text("tiny bench assets\n")
    return paths
