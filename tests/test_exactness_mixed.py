"""Mixed nodes by exact enumeration (docs/EXACTNESS.md, "Mixed nodes"): point masses copied from the
context beside children from the head, in Fractions, against the target's law; negative controls.

The reference is ``tests/exact_reference.py`` (``mixed_checks``, ``check_mixed``,
``mixed_emitted_law``); the tensor verifier is compared with it in ``test_context.py``.
"""

from __future__ import annotations

import random
from fractions import Fraction as F

import pytest

from tests.exact_reference import (
    MIXED_CONTROLS,
    MixedRules,
    check_mixed,
    constant,
    dist,
    dist_table,
    mixed_checks,
    mixed_emitted_law,
    target_law,
    top_tokens,
    total_variation,
)

KINDS = ("deterministic", "with_replacement", "without_replacement")


def _context(seed: int, vocab: int, chance: float = 0.8):
    """A context proposer: at most one token per prefix, a fixed pseudo-random function of it."""

    def fn(prefix):
        rng = random.Random(f"ctx:{seed}:{prefix}")
        return [rng.randrange(vocab)] if rng.random() < chance else []

    return fn


def _width(seed: int, widths=(0, 1, 2)):
    return lambda prefix: random.Random(f"w:{seed}:{prefix}").choice(widths)


def _cases():
    for kind in KINDS:
        for first in ("context", "head"):
            for vocab, seed in ((3, 0), (3, 1), (4, 2), (4, 3)):
                yield pytest.param(kind, first, vocab, seed, id=f"{kind}-{first}-V{vocab}-s{seed}")


@pytest.mark.parametrize("kind, first, vocab, seed", list(_cases()))
def test_mixed_nodes_emit_the_target_law(kind, first, vocab, seed):
    """Depth-2 trees, every node mixed (or not, by chance): the first three emitted tokens follow
    the target's law exactly, whichever proposer is checked first."""
    target, draft = dist_table(seed, vocab), dist_table(100 + seed, vocab)
    law = mixed_emitted_law(kind, target, draft, _context(seed, vocab), _width(seed), depth=2, n_emit=3, first=first)
    assert law == target_law(target, 3)


def test_context_token_drawn_again_by_the_head_is_a_phantom():
    """The drawn child repeating the context token is kept in the check order; the point-mass
    duplicate (head first, or a deterministic head) is dropped."""
    assert mixed_checks([1], [1, 2], "without_replacement", "context") == [(1, False), (1, True), (2, True)]
    assert mixed_checks([1], [1, 2], "without_replacement", "head") == [(1, True), (2, True)]
    assert mixed_checks([1], [1, 2], "deterministic", "context") == [(1, False), (2, False)]


def test_the_phantom_is_rejected_with_certainty_and_moves_the_residual():
    p, q = dist(5, 3, 2), dist(6, 2, 2)
    outcomes = check_mixed([(0, False), (0, True), (2, True)], p, q, "without_replacement")
    assert [i for _, i, _ in outcomes] == [0, 2, None]  # test 1 (the phantom) is never accepted
    assert sum(pr for pr, _, _ in outcomes) == 1
    # without the phantom the third test and the correction see another law
    dropped = check_mixed([(0, False), (2, True)], p, q, "without_replacement")
    assert dropped != outcomes


def test_point_mass_duplicates_change_nothing():
    rules = MixedRules(keep_point_mass_duplicates=True)
    for seed in range(4):
        target, draft = dist_table(seed, 3), dist_table(50 + seed, 3)
        for kind in KINDS:
            law = mixed_emitted_law(kind, target, draft, _context(seed, 3), _width(seed, (1, 2)), depth=2,
                                    first="head", rules=rules)
            assert law == target_law(target, 2)


@pytest.mark.parametrize("kind", ["with_replacement", "without_replacement"])
@pytest.mark.parametrize("control", sorted(MIXED_CONTROLS))
def test_mixed_negative_controls_are_caught(control, kind):
    """Each wrong rule breaks the law in most random cases (3- and 4-token vocabularies; the context
    proposes the head's most likely token, so the head often draws it again; no zero probabilities,
    which make the residual a point mass early and hide the difference)."""
    caught, cases = 0, 0
    for vocab in (3, 4):
        for seed in range(6):
            target, draft = dist_table(seed, vocab, zero_chance=0.0), dist_table(300 + seed, vocab, zero_chance=0.0)
            ctx = lambda prefix, d=draft: [top_tokens(d(prefix), 1)[0]]  # noqa: E731 (the head's favourite)
            law = mixed_emitted_law(kind, target, draft, ctx, _width(seed, (1, 2)), depth=1, n_emit=2,
                                    rules=MIXED_CONTROLS[control])
            right = mixed_emitted_law(kind, target, draft, ctx, _width(seed, (1, 2)), depth=1, n_emit=2)
            expected = target_law(target, 2)
            assert right == expected
            cases += 1
            caught += law != expected
    print(f"{control} / {kind}: caught in {caught} of {cases} random cases")
    assert caught > cases // 2


def test_dropping_the_drawn_duplicate_on_a_worked_case():
    """p = (0.5, 0.3, 0.2), q = (0.2, 0.2, 0.6), context token 2 then one child drawn from q."""
    target, draft = constant(dist("0.5", "0.3", "0.2")), constant(dist("0.2", "0.2", "0.6"))
    ctx = constant([2])
    one = constant(1)
    right = mixed_emitted_law("with_replacement", target, draft, ctx, one, depth=1, n_emit=1)
    assert right == target_law(target, 1)
    wrong = mixed_emitted_law("with_replacement", target, draft, ctx, one, depth=1, n_emit=1,
                              rules=MIXED_CONTROLS["drop_drawn_duplicates"])
    assert total_variation(wrong, right) > F(1, 50)
    as_q = mixed_emitted_law("with_replacement", target, draft, ctx, one, depth=1, n_emit=1,
                             rules=MIXED_CONTROLS["context_as_q"])
    assert total_variation(as_q, right) > F(1, 50)
