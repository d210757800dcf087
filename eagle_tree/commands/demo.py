"""``eagle-tree demo``: the exact verifier on the three-token example of EXACTNESS.md."""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from eagle_tree.core.tree import Tree
from eagle_tree.core.verify import verify_tree


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="eagle-tree demo", description=__doc__)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    rows = torch.stack([p, p])  # row 1 (after the proposed node) is unused: we count the first token
    draft_gen = torch.Generator().manual_seed(args.seed)
    verify_gen = torch.Generator().manual_seed(args.seed + 1)
    first, accepted = Counter(), 0
    for _ in range(args.samples):
        x = int(torch.multinomial(q, 1, generator=draft_gen))
        res = verify_tree(Tree([-1], [x]), rows, torch.stack([q, q]), "with_replacement", verify_gen)
        accepted += bool(res.accepted)
        first[x if res.accepted else res.next_token] += 1
    print("target p = (0.5, 0.3, 0.2), draft q = (0.2, 0.2, 0.6), one sampled proposal")
    print(f"acceptance rate: {accepted / args.samples:.4f}   (exact: 0.6)")
    law = ", ".join(f"{first[t] / args.samples:.4f}" for t in range(3))
    print(f"law of the first emitted token: ({law})   (exact: p)")
    return 0
