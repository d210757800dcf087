"""Draft trees given by parent indices.

Node ``i`` has parent ``parents[i]`` in ``{-1, 0, .., i-1}`` (-1: a child of the root, which is the
last committed token) and token ``tokens[i]``. Nodes are in topological order, children of a node
in proposal order (their index order). A chain is ``parents = [-1, 0, 1, ...]``.

Mixed nodes (docs/EXACTNESS.md, "Mixed nodes"): under the sampled verification rules, ``point_mass[i]``
marks node ``i`` as proposed by a point mass (a token copied from the context) beside siblings
drawn from ``q``; and ``phantoms`` lists drawn children that repeat the token of a point-mass
sibling checked before them: ``(parent, slot, token)`` is checked after the first ``slot`` children
of ``parent``. A phantom is rejected with certainty but its residual update applies; it has no row.

Rows: verification runs the target over ``[root, node 0, node 1, ...]``, so the root is row 0 and
node ``i`` is row ``i + 1`` of the verifier's inputs, logits and probability tables and of the draft's
per-node laws; the cache entries that verification appends sit at the same offsets after the
committed ones. :meth:`Tree.row` and :meth:`Tree.cache_offsets` own that offset; everything else calls
them. ("Row" is only ever a row of these tables: a member of a batch is a request, a cache position a
slot or an offset.)
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

    def __init__(self, parents: Sequence[int] | torch.Tensor, tokens: Sequence[int] | torch.Tensor,
                 point_mass: Sequence[bool] | None = None, phantoms: Sequence[tuple[int, int, int]] = ()):
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
        self.point_mass = None if point_mass is None else [bool(b) for b in point_mass]
        if self.point_mass is not None and len(self.point_mass) != len(self.tokens):
            raise ValueError(f"point_mass needs one flag per node ({len(self.tokens)}), got {len(self.point_mass)}")
        self.phantoms = [(int(a), int(b), int(c)) for a, b, c in phantoms]
        for parent, slot, token in self.phantoms:
            kids = [i for i, p in enumerate(self.parents) if p == parent][:slot] if parent < len(self) else []
            if not any(self.tokens[k] == token and self.is_point_mass(k) for k in kids) or len(kids) < slot:
                raise ValueError(
                    f"phantom {(parent, slot, token)}: a drawn child without a row must repeat the token of a "
                    f"point-mass sibling checked before it (slot <= the number of children of {parent}); "
                    "otherwise it can be accepted and needs a row of its own"
                )

    @classmethod
    def chain(cls, tokens: Sequence[int] | torch.Tensor) -> Tree:
        n = len(tokens)
        return cls(list(range(-1, n - 1)), tokens)

    @staticmethod
    def row(node: int) -> int:
        """Row of ``node`` (``ROOT`` = -1 included) in the verifier's [root, nodes] tables: node + 1."""
        return node + 1

    @staticmethod
    def cache_offsets(nodes: Sequence[int]) -> list[int]:
        """Offsets (from the root's slot) of the root and of ``nodes`` (ascending node indices, e.g. the
        accepted path): the cache entries a round keeps after verification, in order; equal to their rows."""
        return [Tree.row(ROOT), *(Tree.row(node) for node in nodes)]

    def __len__(self) -> int:
        return len(self.parents)

    def __repr__(self) -> str:
        extra = "" if self.point_mass is None else f", point_mass={self.point_mass}"
        extra += f", phantoms={self.phantoms}" if self.phantoms else ""
        return f"Tree(parents={self.parents}, tokens={self.tokens}{extra})"

    def is_point_mass(self, node: int) -> bool:
        """Whether node was marked a point mass (False when no flags were given: the rule decides)."""
        return self.point_mass is not None and self.point_mass[node]

    def checks(self, node: int) -> list[tuple[int, int | None]]:
        """The acceptance tests at ``node`` in order: (token, child index, or None for a phantom)."""
        phantoms = sorted((ph for ph in self.phantoms if ph[0] == node), key=lambda ph: ph[1])
        order: list[tuple[int, int | None]] = []
        j = 0
        for k, c in enumerate(self.children[node]):
            while j < len(phantoms) and phantoms[j][1] <= k:
                order.append((phantoms[j][2], None))
                j += 1
            order.append((self.tokens[c], c))
        return order + [(token, None) for _, _, token in phantoms[j:]]

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

    @cached_property
    def _ancestors(self) -> torch.Tensor:
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p != ROOT:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def ancestor_mask(self) -> torch.Tensor:
        """(n, n) bool: [i, j] is True when j is i or an ancestor of i."""
        return self._ancestors.clone()

    def position_offsets(self) -> torch.Tensor:
        """(n,) int64: depth of each node, added to the root's position."""
        return torch.tensor(self.depth, dtype=torch.long)

    def position_offsets_with_root(self) -> torch.Tensor:
        """(n + 1,) int64 by row: 0 for the root, then the depth of each node."""
        return torch.tensor([0, *self.depth], dtype=torch.long)

    def attention_mask_with_root(self) -> torch.Tensor:
        """(n + 1, n + 1) bool over [root, nodes]: each node sees the root, its ancestors and itself."""
        n = len(self)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[1:, 1:] = self._ancestors
        return mask
