"""Batch 1 through ``generate_batch`` against ``generate``: the cost of the batched loop for one request.

    python decode/batch_overhead.py
    python decode/batch_overhead.py "shapes=[none, chain-2]" new_tokens=128 threads=2

For each shape (names as in ``eagle-tree bench serving``: none, chain-2, tree-d3k3n8, chain-1+ctx8, ...),
decodes the first ``prompts`` test prompts with ``SpeculativeDecoder.generate(p)`` and with
``generate_batch([p])``, alternating call by call, after one warm-up call of each; checks that both give
the same tokens; prints time per output token (wall time of all calls / new tokens) of both, their ratio,
and the throughput of ``generate_batch`` over the same prompts at batch 4.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from eagle_tree.bench.serving import parse_shape
from eagle_tree.bench.timing import interleave
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel
from eagle_tree.utils.config import parse_cli
from eagle_tree.utils.prompts import encode_prompts, read_prompt_file


@dataclass
class OverheadConfig:
    """Batch 1 through generate_batch against generate."""

    target: str = "assets/reference/target"
    """the target model folder"""
    head: str = "assets/reference/head"
    """the draft head folder"""
    prompts_file: str = "assets/reference/prompts/test.jsonl"
    """prompts (.jsonl with a `prompt` field)"""
    prompts: int = 4
    """how many prompts"""
    max_prompt_tokens: int = 128
    """keep the last N tokens of each prompt"""
    new_tokens: int = 64
    """new tokens per call (EOS ignored)"""
    repeats: int = 2
    """calls per prompt and way"""
    shapes: list[str] = field(default_factory=lambda: ["none", "chain-2", "tree-d3k3n8", "chain-1+ctx8"])
    """draft shapes by name (none: plain decoding)"""
    threads: int = 1
    """torch CPU threads"""


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(OverheadConfig, sys.argv[1:] if argv is None else argv, prog="batch_overhead.py")
    from transformers import AutoTokenizer

    torch.set_num_threads(cfg.threads)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    target = TargetModel.from_pretrained(cfg.target)
    head = Eagle3DraftModel.from_pretrained(cfg.head, target=target)
    texts = read_prompt_file(cfg.prompts_file)[: cfg.prompts]
    ids = encode_prompts(tokenizer, texts, vocab_size=target.vocab_size, max_positions=None,
                         max_new_tokens=cfg.new_tokens, truncate="left", max_prompt_tokens=cfg.max_prompt_tokens)
    prompts = [p.reshape(-1) for p in ids]
    print(f"{len(prompts)} prompts x {cfg.new_tokens} tokens x {cfg.repeats} repeats, {cfg.threads} thread(s)")
    print("| shape | generate ms/token | generate_batch([p]) ms/token | ratio | batch 4 tok/s |")
    print("|---|---|---|---|---|")
    n = len(prompts)
    for name in cfg.shapes:
        tree = parse_shape(name)
        dec = SpeculativeDecoder(target, None if tree is None else head, tree=tree or TreeConfig())
        dec.generate(prompts[0], 8), dec.generate_batch([prompts[0]], 8)  # warm-up
        runs = interleave({"generate": lambda b, dec=dec: dec.generate(prompts[b % n], cfg.new_tokens),
                           "generate_batch": lambda b, dec=dec: dec.generate_batch([prompts[b % n]], cfg.new_tokens)},
                          cfg.repeats * n)
        for a, b in zip(runs["generate"], runs["generate_batch"], strict=True):
            if a.value.sequences[0].tolist() != b.value.sequences[0].tolist():
                raise SystemExit(f"{name}: generate and generate_batch gave different tokens")
        one, batch = (sum(t.seconds for t in runs[k]) for k in ("generate", "generate_batch"))
        tokens = sum(t.value.new_tokens for t in runs["generate"])
        (four,) = interleave({"batch 4": lambda _b, dec=dec: dec.generate_batch(prompts[:4], cfg.new_tokens)},
                             1)["batch 4"]
        print(f"| {name} | {1000 * one / tokens:.2f} | {1000 * batch / tokens:.2f} | {batch / one:.3f} | "
              f"{four.value.new_tokens / four.seconds:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
