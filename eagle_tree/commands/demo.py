"""``eagle-tree demo``: the exact verifier on a three-token example (docs/EXACTNESS.md, "A worked example")."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from eagle_tree.commands.flags import parse_flags


@dataclass
class DemoConfig:
    """Sample one draft token from q, verify it against p, and compare the counts with the exact law.

    eagle-tree demo [--samples N] [--seed S]      or      eagle-tree demo samples=N seed=S"""

    samples: int = 100_000
    """Draft-and-verify trials."""
    seed: int = 0
    """Seed of the draft draws (the verifier uses seed + 1)."""

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"samples must be an integer >= 1, got {self.samples!r}")


def main(argv: list[str]) -> int:
    cfg = parse_flags(DemoConfig, argv, prog="eagle-tree demo")
    import torch

    from eagle_tree.core.tree import Tree
    from eagle_tree.core.verify import VerifyRule, verify_tree

    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    rows = torch.stack([p, p])  # row 1 (after the proposed node) is unused: we count the first token
    draft_gen = torch.Generator().manual_seed(cfg.seed)
    verify_gen = torch.Generator().manual_seed(cfg.seed + 1)
    first, accepted = Counter(), 0
    for _ in range(cfg.samples):
        x = int(torch.multinomial(q, 1, generator=draft_gen))
        res = verify_tree(Tree([-1], [x]), rows, torch.stack([q, q]), VerifyRule.WITH_REPLACEMENT, verify_gen)
        accepted += bool(res.accepted)
        first[x if res.accepted else res.next_token] += 1
    print("target p = (0.5, 0.3, 0.2), draft q = (0.2, 0.2, 0.6), one sampled proposal")
    print(f"acceptance rate: {accepted / cfg.samples:.4f}   (exact: 0.6)")
    law = ", ".join(f"{first[t] / cfg.samples:.4f}" for t in range(3))
    print(f"law of the first emitted token: ({law})   (exact: p)")
    return 0
