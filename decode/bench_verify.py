"""Time verify_tree on a 64-node draft tree with a realistic vocabulary, for each proposal kind.

Usage: python decode/bench_verify.py [--vocab 32000] [--repeats 100] [--threads N]

Prints microseconds per call and per node (median over repeats, with p10/p90), plus the torch version
and thread count. The requirement is "well under a millisecond per node". The tree: depth 6, a
branching profile of 4, 3, 2, 2, 1, 1 children per node, trimmed to 64 nodes (breadth first). The
probabilities are processed_probs of random logits (temperature 0.7, top-k 50, top-p 0.95 for the
target; the draft's logits are the target's plus noise), so acceptance is partial, as in practice.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

from eagle_tree import SamplingConfig, Tree, processed_probs, verify_tree
from eagle_tree.bench.timing import repeat_seconds
from eagle_tree.core.verify import VerifyRule
from eagle_tree.decoding.metrics import quantile

BRANCHING = (4, 3, 2, 2, 1, 1)  # children per node at depth 0..5
N_NODES = 64


def tree_shape() -> list[int]:
    """Parent indices of a breadth-first tree with BRANCHING, trimmed to N_NODES nodes."""
    parents: list[int] = []
    frontier = [-1]
    for width in BRANCHING:
        nxt = []
        for node in frontier:
            for _ in range(width):
                if len(parents) == N_NODES:
                    return parents
                parents.append(node)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents


def make_case(kind: str, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    parents = tree_shape()
    n = len(parents)
    logits_p = torch.randn(n + 1, vocab, generator=g) * 3
    logits_q = logits_p + torch.randn(n + 1, vocab, generator=g)
    sampling = SamplingConfig(temperature=0.0 if kind == "greedy" else 0.7, top_k=50, top_p=0.95)
    p = processed_probs(logits_p, sampling)
    q = processed_probs(logits_q, SamplingConfig(temperature=0.7, top_k=50, top_p=0.95))
    tokens = [0] * n
    children: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        children.setdefault(par, []).append(i)
    for par, kids in children.items():
        row = q[par + 1]
        if kind == "with_replacement":
            toks = torch.multinomial(row, len(kids), replacement=True, generator=g)
        elif kind == "without_replacement":
            toks = torch.multinomial(row, len(kids), replacement=False, generator=g)
        else:  # greedy / deterministic: the draft's top-k
            toks = torch.topk(row, len(kids)).indices
        for c, t in zip(kids, toks.tolist(), strict=True):
            tokens[c] = t
    return parents, tokens, p, q


def bench(kind: str, vocab: int, repeats: int, warmup: int = 10) -> tuple[list[float], float]:
    parents, tokens, p, q = make_case(kind, vocab)
    g = torch.Generator().manual_seed(1)
    accepted: list[int] = []

    def once() -> None:
        accepted.append(len(verify_tree(Tree(parents, tokens), p, q, kind, g).accepted))

    times = repeat_seconds(once, repeats, warmup)
    return times, sum(accepted[warmup:]) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = len(tree_shape())
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"python {platform.python_version()}, {platform.machine()}"
    )
    print(f"tree: {n} nodes, depth {len(BRANCHING)}, branching {BRANCHING}; vocab {args.vocab}; "
          f"{args.repeats} repeats")
    print(f"{'proposal':<22}{'us/call':>10}{'us/node':>10}{'p10/node':>10}{'p90/node':>10}{'accepted':>10}")
    for kind in tuple(VerifyRule):
        times, acc = bench(kind, args.vocab, args.repeats)
        us = [t * 1e6 for t in times]
        med, p10, p90 = (quantile(us, q) for q in (0.5, 0.1, 0.9))
        print(f"{kind:<22}{med:>10.1f}{med / n:>10.2f}{p10 / n:>10.2f}{p90 / n:>10.2f}{acc:>10.2f}")
    # Reference points for reading the table: a float64 copy of one (n + 1, V) probability table
    # (verify_tree copies the target's and, for sampled kinds, the draft's), one row's sampling.
    _, _, p, _ = make_case("deterministic", args.vocab)
    row = p[0].double()
    gen = torch.Generator().manual_seed(2)
    for name, fn in [
        ("float64 copy of one (n+1, V) table", lambda: p.to(torch.float64)),
        ("multinomial over one row", lambda: torch.multinomial(row, 1, generator=gen)),
    ]:
        us = [t * 1e6 for t in repeat_seconds(fn, args.repeats // 2, warmup=5)]
        print(f"  {name}: {quantile(us, 0.5):.1f} us")
    if hasattr(os, "getloadavg"):
        print(f"load average during the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
