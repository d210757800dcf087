"""verify_tree on hand-made chains and trees whose outcome is certain, and its input checks.

Forced rejection at the first position, in the middle, full acceptance, sibling fallback; the same
cases for a chain and for a tree; one verifier for both.
"""

from __future__ import annotations

import pytest
import torch

from eagle_tree import Tree, verify_tree
from eagle_tree.core.verify import VerifyRule

V = 5
SAMPLED = ("with_replacement", "without_replacement")
RANDOM_KINDS = ("deterministic", *SAMPLED)


def onehot(*tokens: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def law(*weights: float) -> torch.Tensor:
    w = torch.tensor(weights + (0.0,) * (V - len(weights)))
    return w / w.sum()


def run(parents, tokens, p, q, kind, seed=0):
    tree = parents if isinstance(parents, Tree) else Tree(parents, tokens)
    return verify_tree(tree, p, q, kind, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", tuple(VerifyRule))
@pytest.mark.parametrize("seed", range(5))
def test_full_acceptance_then_bonus(kind, seed):
    """Target point masses on the chain's tokens: all accepted, bonus = the point mass after the leaf."""
    tokens = [3, 1, 4]
    p = onehot(3, 1, 4, 2)
    res = run([-1, 0, 1], tokens, p, p.clone(), kind, seed)
    assert res.accepted == [0, 1, 2] and res.next_token == 2


@pytest.mark.parametrize("kind", tuple(VerifyRule))
@pytest.mark.parametrize("seed", range(5))
def test_forced_rejection_at_the_first_position(kind, seed):
    """p(token of node 0) = 0: nothing accepted; the correction comes from the target's support."""
    p = torch.stack([law(0, 1, 1), law(1), law(1), law(1)])
    q = torch.stack([law(1, 1, 1)] * 4)
    res = run([-1, 0, 1], [0, 0, 0], p, q, kind, seed)
    assert res.accepted == []
    if kind == "greedy":
        assert res.next_token == 1  # argmax, smallest id on the tie
    else:
        assert res.next_token in (1, 2)


@pytest.mark.parametrize("kind", tuple(VerifyRule))
@pytest.mark.parametrize("seed", range(5))
def test_forced_rejection_in_the_middle(kind, seed):
    """Node 0 certain (p = q = point mass), node 1 impossible (p = 0): accepted [0], correction != 2."""
    p = torch.stack([onehot(3)[0], law(1, 1, 0, 1), law(1), law(1)])
    q = torch.stack([onehot(3)[0], law(1, 1, 1, 1), law(1), law(1)])
    res = run([-1, 0, 1], [3, 2, 0], p, q, kind, seed)
    assert res.accepted == [0]
    assert res.next_token in ((0,) if kind == "greedy" else (0, 1, 3))


@pytest.mark.parametrize("kind", tuple(VerifyRule))
@pytest.mark.parametrize("seed", range(5))
def test_a_rejected_sibling_hands_over_to_the_next(kind, seed):
    """Root children 0 (token 1, impossible) and 1 (token 2, the target's point mass): node 1 is
    accepted, then its own child (token 4, certain), then the bonus."""
    p = torch.stack([onehot(2)[0], law(1), law(1), onehot(4)[0], onehot(0)[0]])
    q = torch.stack([law(0, 1, 1), law(1), law(1), law(0, 0, 0, 0, 1), law(1)])
    res = run([-1, 0, -1, 2], [1, 0, 2, 4], p, q, kind, seed)
    assert res.accepted == [2, 3] and res.next_token == 0


@pytest.mark.parametrize("kind", RANDOM_KINDS)
def test_chain_is_the_tree_with_one_child_per_node(kind):
    """Same code path: a chain given as a Tree, as parent lists or as tensors gives the same results."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, V, generator=g), -1)
    q = torch.softmax(torch.randn(4, V, generator=g), -1)
    tokens = [1, 3, 0]
    for seed in range(20):
        a = run(Tree.chain(tokens), None, p, q, kind, seed)
        b = run([-1, 0, 1], tokens, p, q, kind, seed)
        c = run(torch.tensor([-1, 0, 1]), torch.tensor(tokens), p, q, kind, seed)
        assert a == b == c


def test_rejected_duplicate_deterministic_child_is_never_accepted():
    """Deterministic: after rejecting token x, r(x) = 0, so a later sibling with the same token is
    rejected too, and the correction never equals x."""
    p = torch.stack([law(1, 1, 1, 1, 1)] + [law(1)] * 3)
    for seed in range(200):
        res = run([-1, -1, -1], [2, 2, 2], p, None, "deterministic", seed)
        assert res.accepted in ([], [0])
        if not res.accepted:
            assert res.next_token != 2


def test_q_zero_where_p_positive_comes_out_through_the_residual():
    """q(0) = 0 < p(0): token 0 is never proposed but must still be emitted (by the correction)."""
    p = torch.stack([law(1, 1), law(1)])
    q = torch.stack([law(0, 1), law(1)])
    seen = {run([-1], [1], p, q, "with_replacement", seed).next_token for seed in range(100)}
    assert 0 in seen


# ----------------------------------------------------------------------------- input checks


def test_unknown_rule():
    with pytest.raises(ValueError, match="unknown verification rule"):
        run([-1], [0], torch.stack([law(1)] * 2), None, "sampled", 0)


@pytest.mark.parametrize("rows", [1, 3])
def test_target_rows_must_be_n_plus_one(rows):
    with pytest.raises(ValueError, match=r"target_probs must have shape \(n \+ 1, V\)"):
        run([-1], [0], torch.stack([law(1)] * rows), None, "deterministic", 0)


def test_target_probs_must_be_two_dimensional():
    with pytest.raises(ValueError, match="target_probs"):
        run([-1], [0], law(1), None, "deterministic", 0)


@pytest.mark.parametrize("kind", SAMPLED)
def test_sampled_proposals_need_draft_probs_of_the_same_shape(kind):
    p = torch.stack([law(1)] * 2)
    with pytest.raises(ValueError, match="needs draft_probs"):
        run([-1], [0], p, None, kind, 0)
    with pytest.raises(ValueError, match="draft_probs must have the shape"):
        run([-1], [0], p, torch.stack([law(1)] * 3), kind, 0)


def test_token_outside_the_vocabulary():
    with pytest.raises(ValueError, match="vocabulary size"):
        run([-1], [V], torch.stack([law(1)] * 2), None, "deterministic", 0)


@pytest.mark.parametrize("kind", SAMPLED)
def test_sampled_child_with_zero_draft_probability_is_an_error(kind):
    p = torch.stack([law(1, 1), law(1)])
    q = torch.stack([law(1), law(1)])  # q(1) = 0: token 1 cannot have been sampled
    with pytest.raises(ValueError, match="zero probability under draft_probs"):
        run([-1], [1], p, q, kind, 0)


def test_malformed_tree_is_an_error():
    with pytest.raises(ValueError, match="parent"):
        run([0], [0], torch.stack([law(1)] * 2), None, "deterministic", 0)


def test_verify_tree_takes_a_tree():
    with pytest.raises(TypeError, match=r"takes a Tree"):
        verify_tree([-1], torch.stack([law(1)] * 2), None, "deterministic", None)


def test_rule_enum_accepts_its_string_values():
    assert [VerifyRule.of(r.value) for r in VerifyRule] == list(VerifyRule)
    assert VerifyRule.WITHOUT_REPLACEMENT.needs_draft_probs and not VerifyRule.DETERMINISTIC.needs_draft_probs
