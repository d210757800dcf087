"""Exact acceptance for a draft tree: branch-wise residuals (docs/EXACTNESS.md, "The verification rules").

Notation: ``p`` is the target's processed distribution at a node, ``q`` the law the node's children
were proposed from, ``r`` the running residual. Children of a node are checked in proposal order:
child ``c_k`` with proposal law ``Q_k`` is accepted with probability ``min(1, r(c_k) / Q_k(c_k))``;
on rejection ``r <- normalise((r - Q_k)_+)``. If every child is rejected the correction token is
drawn from ``r``; if an accepted node has no children the bonus token is drawn from ``p`` there.
A chain is the tree with one child per node: same code, same tests.

Pure tensor code: no model, cache or tokenizer. The verifier draws from its own generator only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from eagle_tree.core.sampling import greedy_token
from eagle_tree.core.tree import ROOT, Tree


class VerifyRule(str, Enum):
    """How the children of every node were proposed, which fixes the exact acceptance rule.

    GREEDY: temperature 0; a child is accepted iff it is the target's argmax (no randomness).
    DETERMINISTIC: children are point masses (top-k of the draft); ratio ``r(x)``, residual zeroes ``x``.
    WITH_REPLACEMENT: children drawn i.i.d. from ``q``; ratio ``r(x) / q(x)``, residual ``(r - q)_+``.
    WITHOUT_REPLACEMENT: children drawn from ``q`` with earlier siblings removed (Gumbel-top-k); as
    WITH_REPLACEMENT, with ``q`` renormalised after zeroing each rejected sibling.
    """

    GREEDY = "greedy"
    DETERMINISTIC = "deterministic"
    WITH_REPLACEMENT = "with_replacement"
    WITHOUT_REPLACEMENT = "without_replacement"

    @classmethod
    def of(cls, value: VerifyRule | str) -> VerifyRule:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown verification rule {value!r}; expected one of {[r.value for r in cls]}") from None

    @classmethod
    def for_draft(cls, greedy: bool, sampled: bool = False) -> VerifyRule:
        """The rule that is exact for children drawn (``sampled``, Gumbel-top-k) or taken as point masses
        (top-k, context copies, the empty tree of plain decoding), under greedy or sampled decoding."""
        if greedy:
            return cls.GREEDY
        return cls.WITHOUT_REPLACEMENT if sampled else cls.DETERMINISTIC

    @property
    def needs_draft_probs(self) -> bool:
        return self in (VerifyRule.WITH_REPLACEMENT, VerifyRule.WITHOUT_REPLACEMENT)


@dataclass
class Proposal:
    """What a drafter hands to the verifier: a draft tree in target token ids, the law its children
    came from (``draft_probs`` (n + 1, V), row 0 = the root's children, row i + 1 = node i's; None for
    point-mass children) and the rule that is exact for them."""

    tree: Tree
    draft_probs: torch.Tensor | None
    rule: VerifyRule

    @classmethod
    def empty(cls, greedy: bool) -> Proposal:
        """The empty tree of plain decoding: the round commits the target's own next token."""
        return cls(Tree([], []), None, VerifyRule.for_draft(greedy))


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
    exceeds u * total (never a zero-probability token). A row without positive finite mass (NaN, all
    zero) is a ValueError, never an index past the vocabulary."""
    cdf = dist.cumsum(0)
    total = float(cdf[-1])
    if not 0 < total < float("inf"):
        raise ValueError(f"cannot draw a token from a distribution of total mass {total} (NaN, infinite or zero "
                         "probabilities); the target or draft scores are invalid")
    u = torch.rand((), generator=generator, dtype=torch.float64)
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if index >= len(dist):  # rounding at the top: the last token with mass
        index = int(torch.nonzero(dist > 0)[-1])
    return index


def _check_inputs(tree: Tree, target_probs, draft_probs, rule: VerifyRule) -> None:
    if not isinstance(tree, Tree):
        raise TypeError(f"verify_tree takes a Tree (Tree(parents, tokens)), got {type(tree).__name__}")
    n = len(tree)
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(
            f"target_probs must have shape (n + 1, V) = ({n + 1}, V) for a tree of {n} nodes, "
            f"got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[1]
    if any(t >= vocab for t in tree.tokens):
        raise ValueError(f"a tree token id is >= the vocabulary size {vocab}")
    if rule.needs_draft_probs:
        if draft_probs is None:
            raise ValueError(f"rule {rule.value!r} needs draft_probs, the law the children were drawn from")
        if tuple(draft_probs.shape) != tuple(target_probs.shape):
            raise ValueError(
                f"draft_probs must have the shape of target_probs {tuple(target_probs.shape)}, "
                f"got {tuple(draft_probs.shape)}"
            )


def verify_tree(
    tree: Tree,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    rule: VerifyRule | str,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Walk the tree from the root and return the accepted path and the next token.

    target_probs: (n + 1, V), row 0 = processed target distribution at the root, row i + 1 = after
    node i. draft_probs: same shape, the law each row's children were proposed from (unused by
    "greedy" and "deterministic"). For "greedy" the target's choice at a row is its argmax
    (smallest id on ties) and no randomness is drawn.
    """
    rule = VerifyRule.of(rule)
    _check_inputs(tree, target_probs, draft_probs, rule)
    # Rows are converted to float64 when visited: the walk reads about depth + 1 of the n + 1 rows.
    p_all = _Rows(target_probs)
    q_all = _Rows(draft_probs) if draft_probs is not None and rule.needs_draft_probs else None

    accepted: list[int] = []
    node = ROOT
    while True:
        row = Tree.row(node)
        kids = tree.children[node]
        if rule is VerifyRule.GREEDY:
            choice = int(greedy_token(p_all[row]))
            match = next((c for c in kids if tree.tokens[c] == choice), None)
            if match is None:
                return VerifyResult(accepted, choice)
            accepted.append(match)
            node = match
            continue
        if not kids:  # bonus token from p at the accepted leaf
            return VerifyResult(accepted, _sample(p_all[row], generator))
        child, residual = _check_children(tree, node, p_all[row], q_all, row, rule, generator)
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


def _check_children(tree: Tree, node: int, p, q_all, row, rule: VerifyRule, generator):
    """Branch-wise residual over the checks of one node (children and phantoms, Tree.checks).
    Returns (accepted child or None, r). Each check carries its own law ``Q_k``: a point mass for
    every child under the deterministic rule and for children marked ``point_mass`` (mixed nodes);
    otherwise ``q``, with the earlier drawn siblings (phantoms included) removed under the
    without-replacement rule."""
    r = p.clone()
    sampled = rule.needs_draft_probs
    q = q_all[row].clone() if sampled and q_all is not None else None
    for x, c in tree.checks(node):
        if c is None and not sampled:  # a point-mass duplicate changes nothing
            continue
        point_mass = not sampled or (c is not None and tree.is_point_mass(c))
        if point_mass:
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
            if c is None:
                raise ValueError(f"a phantom check (token {x}) at row {row} was accepted: its residual was not zero")
            return c, r
        if point_mass:
            r[x] = 0.0
            new_r = _normalise(r)
        else:
            new_r = _normalise((r - q).clamp_min(0.0))
            if rule is VerifyRule.WITHOUT_REPLACEMENT:
                q[x] = 0.0
                q = _normalise(q)
                if q is None:  # every token of q has been proposed: no further sibling can exist
                    q = torch.zeros_like(r)
        # The residual's mass equals the rejection probability, zero only when acceptance was
        # certain; in floating point it can vanish, and then r itself is the only sound law left.
        r = new_r if new_r is not None else r
    return None, r


def sample_token(probs: torch.Tensor, greedy: bool, generator: torch.Generator | None) -> int:
    """One token from a processed distribution (V,): the argmax (smallest id on ties) when ``greedy``,
    else an inverse-CDF draw from ``generator``. The decoder's first token after the prefill is drawn
    so: the rule the verifier applies at an accepted node without children."""
    row = probs.detach().reshape(-1).to("cpu", torch.float64)
    return int(greedy_token(row)) if greedy else _sample(row, generator)
