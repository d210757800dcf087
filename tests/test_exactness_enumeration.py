"""Exactness by enumeration (docs/EXACTNESS.md, "Claims and the tests"): every draft and verifier outcome, in Fractions.

The reference algorithm lives in ``tests/exact_reference.py``; here its output law is compared with
the target's for every proposal kind, and every known wrong rule is shown to break the equality.
"""

from __future__ import annotations

import itertools
from fractions import Fraction as F

import pytest

from tests.exact_reference import (
    CORRECT,
    KINDS,
    NEGATIVE_CONTROLS,
    ONE,
    check_children,
    constant,
    dist,
    dist_table,
    draft_outcomes,
    emitted_law,
    marginal_first,
    positive_part,
    target_law,
    top_k_dist,
    total_variation,
    verify_law,
)

# The worked example of docs/EXACTNESS.md ("A worked example"): tokens A, B, C.
P = dist("0.5", "0.3", "0.2")
Q = dist("0.2", "0.2", "0.6")

# Tree shapes (parent indices), depth up to 3, several children per node.
SHAPES = {
    "chain": [-1, 0, 1],
    "fan": [-1, -1, -1],  # three children of the root, all leaves
    "tree": [-1, -1, -1, 0, 0, 1, 3],  # root: 3 children; node 0: 2; node 1: 1; node 3: 1 (depth 3)
    "bushy": [-1, -1, 0, 0, 1, 2, 2],  # 2 children per node down to depth 3
}


# ----------------------------------------------------------------------------- the worked example


def test_worked_example_acceptance_residual_and_output_law():
    acceptance = tuple(min(ONE, p / q) for p, q in zip(P, Q, strict=True))
    assert acceptance == (1, 1, F(1, 3))
    assert sum(q * a for q, a in zip(Q, acceptance, strict=True)) == F(3, 5)
    assert positive_part(P, Q) == (F(3, 4), F(1, 4), 0)
    law = emitted_law("with_replacement", [-1], constant(P), n_emit=1, draft=constant(Q))
    assert law == {(0,): F(1, 2), (1,): F(3, 10), (2,): F(1, 5)}


def test_worked_example_one_child_outcomes():
    """Per drafted token: C is accepted with 1/3, else the correction comes from (3/4, 1/4, 0)."""
    assert check_children([0], P, Q, "with_replacement") == [(ONE, 0, ())]
    assert check_children([2], P, Q, "with_replacement") == [
        (F(1, 3), 0, ()),
        (F(2, 3), None, (F(3, 4), F(1, 4), F(0))),
    ]


def test_worked_example_fresh_sample_from_p_is_wrong():
    law = emitted_law(
        "with_replacement", [-1], constant(P), 1, draft=constant(Q),
        rules=NEGATIVE_CONTROLS["fresh_p_after_rejection"],
    )
    assert law == {(0,): F(2, 5), (1,): F(8, 25), (2,): F(7, 25)}  # (0.4, 0.32, 0.28), not p


def test_expected_committed_tokens_of_a_chain_is_exact():
    """Chain of g = 3 sampled proposals, p and q of the worked example at every position.

    Each node is accepted with probability sum(min(p, q)) = 0.6 whatever its token, independently of
    the other nodes, so the committed tokens per round (accepted + 1) have mean
    (1 - a^(g+1)) / (1 - a) = 2.176 and Pr(accepted >= i) = a^i.
    """
    a, g = F(3, 5), 3
    assert sum(min(p, q) for p, q in zip(P, Q, strict=True)) == a
    formula = (1 - a ** (g + 1)) / (1 - a)
    assert formula == F(2176, 1000)
    chain = [-1, 0, 1]
    accepted_law = {i: F(0) for i in range(g + 1)}
    for tokens in itertools.product(range(3), repeat=g):
        pr_draft = Q[tokens[0]] * Q[tokens[1]] * Q[tokens[2]]
        law = verify_law(chain, list(tokens), [P] * (g + 1), [Q] * (g + 1), "with_replacement")
        for (accepted, _), pr in law.items():
            accepted_law[len(accepted)] += pr_draft * pr
    assert sum(accepted_law.values()) == 1
    assert sum((n + 1) * pr for n, pr in accepted_law.items()) == formula
    for i in range(1, g + 1):
        assert sum(pr for n, pr in accepted_law.items() if n >= i) == a**i


# ----------------------------------------------------------------------------- the draft's laws


def test_draft_outcomes_are_laws():
    q = dist(0, 1, 2, 3)
    for kind in ("with_replacement", "without_replacement"):
        outs = draft_outcomes(q, 3, kind)
        assert sum(pr for _, pr in outs) == 1
    wo = dict(draft_outcomes(q, 2, "without_replacement"))
    assert all(len(set(t)) == len(t) for t in wo)  # never a repeated token
    assert wo[(3, 2)] == F(3, 6) * F(2, 3)  # sequential sampling: q(3), then q(2) / (1 - q(3))
    assert all(0 not in t for t in wo)  # zero draft probability: never proposed
    exhausted = dict(draft_outcomes(dist(0, 1, 1), 3, "without_replacement"))
    assert exhausted == {(1, 2): F(1, 2), (2, 1): F(1, 2)}  # support exhausted: fewer children


# ----------------------------------------------------------------------------- exactness, all kinds


def _cases():
    for kind in KINDS:
        for shape in SHAPES:
            for vocab, seed in ((3, 0), (4, 1), (5, 2)):
                yield pytest.param(kind, shape, vocab, seed, id=f"{kind}-{shape}-V{vocab}-s{seed}")


@pytest.mark.parametrize("kind, shape, vocab, seed", list(_cases()))
def test_emitted_law_equals_target_law(kind, shape, vocab, seed):
    """Zeros and ties come from the small integer weights of ``dist_table``; q != p."""
    target = dist_table(seed, vocab)
    draft = dist_table(1000 + seed, vocab)
    greedy = kind == "greedy"
    for n_emit in (1, 2, 3):
        law = emitted_law(kind, SHAPES[shape], target, n_emit, draft=draft)
        assert law == target_law(target, n_emit, greedy), f"n_emit={n_emit}"
    # the first emitted token is the marginal of the joint law of the first two
    assert marginal_first(emitted_law(kind, SHAPES[shape], target, 2, draft=draft)) == target_law(
        target, 1, greedy
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_emitted_law_with_alpha_one(kind, shape):
    """p == q: sampled children are always accepted; the law is still the target's."""
    target = dist_table(7, 4)
    law = emitted_law(kind, SHAPES[shape], target, 3, draft=target)
    assert law == target_law(target, 3, kind == "greedy")


@pytest.mark.parametrize("kind", ["greedy", "deterministic"])
def test_deterministic_trees_with_duplicates_and_impossible_tokens(kind):
    """Fixed tokens, repeated siblings and tokens the target gives probability zero."""
    target = dist_table(3, 4, zero_chance=0.4)

    def token_fn(prefix, k):
        zero = [y for y, w in enumerate(target(prefix)) if w == 0]
        pool = [zero[0] if zero else 0, 1, 1, 2, 3]  # an impossible token first, then a duplicate
        return pool[:k]

    for shape in ("tree", "bushy", "fan"):
        law = emitted_law(kind, SHAPES[shape], target, 3, token_fn=token_fn)
        assert law == target_law(target, 3, kind == "greedy")


def test_sampled_kinds_when_the_draft_misses_target_tokens():
    """q(x) = 0 < p(x): such tokens can only come out through the residual, and they do."""
    target = constant(dist(1, 1, 1, 1))
    draft = constant(dist(0, 0, 1, 3))
    for kind in ("with_replacement", "without_replacement"):
        law = emitted_law(kind, SHAPES["tree"], target, 2, draft=draft)
        assert law == target_law(target, 2)


def test_the_checker_is_not_vacuous():
    """The equality check sees a change of target: the law of another model is rejected."""
    target = dist_table(0, 4)
    other = dist_table(1, 4)
    assert emitted_law("with_replacement", SHAPES["tree"], target, 2, draft=other) != target_law(other, 2)


# ----------------------------------------------------------------------------- negative controls
#
# Each known wrong rule must make the same equality check fail. The cases are small on purpose; the
# total variation distance of each is printed by ``-s`` and asserted to be clearly non-zero.

RAW = dist(5, 3, 2)  # raw softmax at every position; the processed target is its top-2, renormalised
CONTROL_CASES = {
    # name: (kind, shape, target, draft, raw)
    "fresh_p_after_rejection": ("with_replacement", [-1], constant(P), constant(Q), None),
    "draft_softmax_as_q": ("deterministic", [-1], constant(P), constant(Q), None),
    "reused_draft_noise": ("with_replacement", [-1], constant(P), constant(Q), None),
    "sorted_children": ("with_replacement", [-1, -1, -1], constant(P), constant(Q), None),
    "skip_duplicates": ("with_replacement", [-1, -1, -1], constant(P), constant(Q), None),
    "bonus_from_raw": ("deterministic", [-1], constant(top_k_dist(RAW, 2)), None, constant(RAW)),
    "decision_per_path": ("deterministic", [-1, -1, 0, 1], constant(P), None, None),
    "unremoved_siblings": ("without_replacement", [-1, -1], constant(P), constant(Q), None),
}


@pytest.mark.parametrize("control", sorted(NEGATIVE_CONTROLS))
def test_negative_control_is_rejected(control):
    kind, shape, target, draft, raw = CONTROL_CASES[control]
    wrong = emitted_law(kind, shape, target, 2, draft=draft, rules=NEGATIVE_CONTROLS[control], raw=raw)
    right = emitted_law(kind, shape, target, 2, draft=draft, rules=CORRECT, raw=raw)
    expected = target_law(target, 2)
    assert right == expected  # the same case passes under the correct rule
    tv = total_variation(wrong, expected)
    print(f"{control}: total variation {float(tv):.4f}")
    assert wrong != expected
    assert tv > F(1, 50)


@pytest.mark.parametrize("kind", ["with_replacement", "without_replacement"])
@pytest.mark.parametrize("control", ["fresh_p_after_rejection", "reused_draft_noise", "sorted_children"])
def test_sampled_negative_controls_are_rejected_on_random_trees(control, kind):
    """Beyond the hand-picked cases: the wrong rules also fail on random depth-3 trees."""
    caught = 0
    for seed in range(4):
        target, draft = dist_table(seed, 4), dist_table(500 + seed, 4)
        law = emitted_law(kind, SHAPES["tree"], target, 2, draft=draft, rules=NEGATIVE_CONTROLS[control])
        caught += law != target_law(target, 2)
    assert caught >= 2


def test_skipped_duplicates_only_matter_for_sampled_children():
    """Deterministic duplicates are rejected for sure after the first (r(x) = 0): skipping is harmless,
    but for i.i.d. children a skipped duplicate loses a residual update."""
    target = dist_table(11, 3)
    rules = NEGATIVE_CONTROLS["skip_duplicates"]
    tf = lambda prefix, k: [0, 0, 1][:k]
    det = emitted_law("deterministic", SHAPES["fan"], target, 2, token_fn=tf, rules=rules)
    assert det == target_law(target, 2)
    law = emitted_law("with_replacement", SHAPES["fan"], constant(P), 2, draft=constant(Q), rules=rules)
    assert law != target_law(constant(P), 2)
