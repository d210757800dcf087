"""Exact acceptance for a draft tree: branch-wise residuals (see EXACTNESS.md).

Notation: ``p`` is the target's processed distribution at a node, ``q`` the law the node's children
were proposed from, ``r`` the running residual. Children of a node are checked in proposal order:
child ``c_k`` with proposal law ``Q_k`` is accepted with probability ``min(1, r(c_k) / Q_k(c_k))``;
on rejection ``r <- normalise((r - Q_k)_+)``. If every child is rejected the correction token is
drawn from ``r``; if an accepted node has no children the bonus token is drawn from ``p`` there.
A chain is the tree with one child per node: same code, same tests.

Pure tensor code: no model, cache or tokenizer. The verifier draws from its own generator only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eagle_tree.core.sampling import greedy_token
from eagle_tree.core.tree import ROOT, Tree

PROPOSALS = ("greedy", "deterministic", "with_replacement", "without_replacement")


@dataclass
class VerifyResult:
    """accepted: accepted node indices along one root-to-node path; next_token: correction or bonus."""

    accepted: list[int]
    next_token: int


def _normalise(x: torch.Tensor) -> torch.Tensor | None:
    mass = x.sum()
    return x / mass if mass > 0 else None


def _sample(dist: torch.Tensor, generator: torch.Generator | None) -> int:
    """Inverse-CDF draw from an unnormalised float64 row: the first token whose cumulative mass
    exceeds u * total (never a zero-probability token)."""
    cdf = dist.cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if index >= len(dist):  # rounding at the top: the last token with mass
        index = int(torch.nonzero(dist > 0)[-1])
    return index


def _check_inputs(tree: Tree, target_probs, draft_probs, proposal: str) -> None:
    if proposal not in PROPOSALS:
        raise ValueError(f"unknown proposal {proposal!r}; expected one of {PROPOSALS}")
    n = len(tree)
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(
            f"target_probs must have shape (n + 1, V) = ({n + 1}, V) for a tree of {n} nodes, "
            f"got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[1]
    if any(t >= vocab for t in tree.tokens):
        raise ValueError(f"a tree token id is >= the vocabulary size {vocab}")
    if proposal in ("with_replacement", "without_replacement"):
        if draft_probs is None:
            raise ValueError(f"proposal {proposal!r} needs draft_probs, the law the children were drawn from")
        if tuple(draft_probs.shape) != tuple(target_probs.shape):
            raise ValueError(
                f"draft_probs must have the shape of target_probs {tuple(target_probs.shape)}, "
                f"got {tuple(draft_probs.shape)}"
            )


def verify_tree(
    parents: Sequence[int] | torch.Tensor | Tree,
    tokens: Sequence[int] | torch.Tensor | None,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    proposal: str,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Walk the tree from the root and return the accepted path and the next token.

    target_probs: (n + 1, V), row 0 = processed target distribution at the root, row i + 1 = after
    node i. draft_probs: same shape, the law each row's children were proposed from (unused by
    "greedy" and "deterministic"). For "greedy" the target's choice at a row is its argmax
    (smallest id on ties) and no randomness is drawn.
    """
    tree = parents if isinstance(parents, Tree) else Tree(parents, tokens)
    _check_inputs(tree, target_probs, draft_probs, proposal)
    # Rows are converted to float64 when visited: the walk reads about depth + 1 of the n + 1 rows.
    p_all = _Rows(target_probs)
    q_all = None if draft_probs is None or proposal in ("greedy", "deterministic") else _Rows(draft_probs)

    accepted: list[int] = []
    node = ROOT
    while True:
        row = node + 1
        kids = tree.children[node]
        if proposal == "greedy":
            choice = int(greedy_token(p_all[row]))
            match = next((c for c in kids if tree.tokens[c] == choice), None)
            if match is None:
                return VerifyResult(accepted, choice)
            accepted.append(match)
            node = match
            continue
        if not kids:  # bonus token from p at the accepted leaf
            return VerifyResult(accepted, _sample(p_all[row], generator))
        child, residual = _check_children(kids, tree.tokens, p_all[row], q_all, row, proposal, generator)
        if child is None:  # every child rejected: correction from the residual
            return VerifyResult(accepted, _sample(residual, generator))
        accepted.append(child)
        node = child


class _Rows:
    """Lazy float64 CPU view of the rows of a (n + 1, V) table."""

    def __init__(self, table: torch.Tensor):
        self.table = table.detach()

    def __getitem__(self, row: int) -> torch.Tensor:
        return self.table[row].to("cpu", torch.float64)


def _check_children(kids, tokens, p, q_all, row, proposal, generator):
    """Branch-wise residual over the children of one node. Returns (accepted child or None, r)."""
    r = p.clone()
    q = None if q_all is None or proposal == "deterministic" else q_all[row].clone()
    for c in kids:
        x = tokens[c]
        if proposal == "deterministic":
            ratio = r[x]  # Q_k is a point mass on x
        else:
            if q[x] <= 0:
                raise ValueError(
                    f"child {c} has token {x} with zero probability under draft_probs row {row}; "
                    "it cannot have been sampled from that law"
                )
            ratio = r[x] / q[x]
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if u < ratio:
            return c, r
        if proposal == "deterministic":
            r[x] = 0.0
            new_r = _normalise(r)
        else:
            new_r = _normalise((r - q).clamp_min(0.0))
            if proposal == "without_replacement":
                q[x] = 0.0
                q = _normalise(q)
                if q is None:  # every token of q has been proposed: no further sibling can exist
                    q = torch.zeros_like(r)
        # The residual's mass equals the rejection probability, zero only when acceptance was
        # certain; in floating point it can vanish, and then r itself is the only sound law left.
        r = new_r if new_r is not None else r
    return None, r
