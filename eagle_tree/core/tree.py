"""Draft trees given by parent indices.

Node ``i`` has parent ``parents[i]`` in ``{-1, 0, .., i-1}`` (-1: a child of the root, which is the
last committed token) and token ``tokens[i]``. Nodes are in topological order, children of a node
in proposal order (their index order). A chain is ``parents = [-1, 0, 1, ...]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch

ROOT = -1


def _as_int_list(values, name: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {tuple(values.shape)}")
        return [int(v) for v in values.tolist()]
    out = []
    for v in values:
        if isinstance(v, bool) or int(v) != v:
            raise ValueError(f"{name} must hold integers, got {v!r}")
        out.append(int(v))
    return out


class Tree:
    """A validated draft tree with the derived views the decoder and verifier need."""

    def __init__(self, parents: Sequence[int] | torch.Tensor, tokens: Sequence[int] | torch.Tensor):
        self.parents = _as_int_list(parents, "parents")
        self.tokens = _as_int_list(tokens, "tokens")
        if len(self.parents) != len(self.tokens):
            raise ValueError(
                "parents and tokens must have the same length, "
                f"got {len(self.parents)} and {len(self.tokens)}"
            )
        for i, p in enumerate(self.parents):
            if p < ROOT or p >= i:
                raise ValueError(
                    f"node {i} has parent {p}: parents must be -1 (the root) or an earlier node index "
                    f"(0..{i - 1}); a later or equal index would make a cycle or break topological order"
                )
        for i, t in enumerate(self.tokens):
            if t < 0:
                raise ValueError(f"node {i} has negative token id {t}")

    @classmethod
    def chain(cls, tokens: Sequence[int] | torch.Tensor) -> Tree:
        n = len(tokens)
        return cls(list(range(-1, n - 1)), tokens)

    def __len__(self) -> int:
        return len(self.parents)

    def __repr__(self) -> str:
        return f"Tree(parents={self.parents}, tokens={self.tokens})"

    @cached_property
    def depth(self) -> list[int]:
        """Depth of each node: 1 for children of the root."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p == ROOT else d[p] + 1)
        return d

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    @cached_property
    def children(self) -> dict[int, list[int]]:
        """Children of each node (ROOT = -1 included), in proposal order."""
        kids: dict[int, list[int]] = {i: [] for i in range(ROOT, len(self))}
        for i, p in enumerate(self.parents):
            kids[p].append(i)
        return kids

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first node under the root down to ``node`` (inclusive)."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @cached_property
    def leaves(self) -> list[int]:
        return [i for i in range(len(self)) if not self.children[i]]

    @cached_property
    def paths(self) -> list[list[int]]:
        """Root-to-leaf paths (node indices, root excluded), in leaf index order."""
        return [self.path_to(leaf) for leaf in self.leaves]

    def ancestor_mask(self) -> torch.Tensor:
        """(n, n) bool: [i, j] is True when j is i or an ancestor of i."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p != ROOT:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def position_offsets(self) -> torch.Tensor:
        """(n,) int64: depth of each node, added to the root's position."""
        return torch.tensor(self.depth, dtype=torch.long)

    def attention_mask_with_root(self) -> torch.Tensor:
        """(n + 1, n + 1) bool over [root, nodes]: each node sees the root, its ancestors and itself."""
        n = len(self)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[1:, 1:] = self.ancestor_mask()
        return mask
