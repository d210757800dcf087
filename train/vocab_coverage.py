"""How much of held-out text a draft vocabulary covers: the ceiling it puts on per-token acceptance.

    python train/vocab_coverage.py --target $(eagle-tree reference smollm2 | tail -1) \
        --train assets/smollm2/data/train.jsonl \
        --heldout assets/smollm2/data/tuning.jsonl assets/smollm2/data/test.jsonl --sizes 8192 16384 32768

The draft vocabulary of each size is built from the training conversations exactly as training builds
it (``build_draft_vocab``: the most frequent loss-masked tokens); the held-out conversations' reply
tokens (loss-masked, through the chat template) are then counted in or out. A token outside the draft
vocabulary can never be drafted, so the share inside bounds the head's top-1 agreement and each
chain step's acceptance from above. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch

from eagle_tree.models.gguf import load_tokenizer
from eagle_tree.training.data import build_draft_vocab, encode_conversation


def _examples(path: str, tokenizer) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [encode_conversation(json.loads(line)["conversations"], tokenizer) for line in f if line.strip()]


def coverage(train: list[dict], heldout: list[dict], vocab_size: int, sizes: list[int]) -> dict[int, float]:
    """Per draft-vocabulary size, the share of ``heldout``'s loss-masked tokens inside the vocabulary
    built from ``train``."""
    ids = torch.tensor([t for e in heldout for t, m in zip(e["input_ids"], e["loss_mask"], strict=True) if m],
                       dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("the held-out conversations hold no reply tokens")
    out = {}
    for size in sizes:
        inside = torch.zeros(vocab_size, dtype=torch.bool)
        inside[build_draft_vocab(train, vocab_size, size)] = True
        out[size] = float(inside[ids].float().mean())
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target folder (its tokenizer and chat template)")
    p.add_argument("--train", required=True, help="training conversations (.jsonl with 'conversations')")
    p.add_argument("--heldout", nargs="+", required=True, help="held-out conversations, never trained on")
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768])
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(args.target)
    train = _examples(args.train, tokenizer)
    heldout = [e for path in args.heldout for e in _examples(path, tokenizer)]
    shares = coverage(train, heldout, len(tokenizer), args.sizes)
    tokens = sum(sum(e["loss_mask"]) for e in heldout)
    print(json.dumps({"heldout_reply_tokens": tokens, "coverage": {str(k): round(v, 4) for k, v in shares.items()}}))


if __name__ == "__main__":
    main()
