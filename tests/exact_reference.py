"""Exact reference for speculative verification: pure Python, ``fractions.Fraction`` throughout.

This module mirrors docs/EXACTNESS.md ("The verification rules") and is the yardstick of the exactness suite. It knows
nothing of ``eagle_tree``; the tests compare the real tensor implementation against it (Monte Carlo)
and compare its own output laws against the target's law (exact enumeration).

Notation as in the design: ``p`` the target's processed distribution at a node, ``q`` the draft's
law, ``r`` the running residual, ``Q_k`` the true proposal law of the k-th child of a node.

Two ways to use it:

- ``verify_law``: the exact law of ``(accepted node indices, next token)`` for one fixed tree with
  given probability rows, as ``verify_tree`` would produce it.
- ``emitted_law``: the exact law of the first ``n_emit`` emitted tokens when a draft proposes a tree
  of a given shape (deterministic tokens, i.i.d. samples from ``q``, or sequential sampling without
  replacement from ``q``, the law of Gumbel-top-k), the verifier accepts a path and emits one more
  token, and the target then continues token by token. Every draft outcome is enumerated with its
  exact probability. Compare with ``target_law``.

Known wrong rules (the negative controls in docs/EXACTNESS.md, "Claims and the tests") are switched on through
``Rules``; a check that accepts them proves nothing.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cache

Dist = tuple[Fraction, ...]
Prefix = tuple[int, ...]
DistFn = Callable[[Prefix], Dist]
TokenFn = Callable[[Prefix, int], Sequence[int]]

KINDS = ("greedy", "deterministic", "with_replacement", "without_replacement")
SAMPLED = ("with_replacement", "without_replacement")
ZERO = Fraction(0)
ONE = Fraction(1)


@dataclass(frozen=True)
class Rules:
    """Which (wrong) rule to apply; the default instance is the correct algorithm.

    fresh_p_after_rejection: no residual; every sibling is tested against ``p`` and the correction
        is a fresh sample from ``p``.
    draft_softmax_as_q: deterministic proposals verified as if sampled from the draft's softmax
        (accept with ``min(1, r / q)``, residual ``(r - q)_+``) instead of a point mass.
    reused_draft_noise: the uniform that drew a sampled child by inverse CDF of ``Q_k`` is reused for
        that child's acceptance test.
    sorted_children: sampled children re-sorted by ``q`` (descending, stable) before verification.
    skip_duplicates: a child whose token repeats an earlier sibling's is skipped (not checked, no
        residual update).
    bonus_from_raw: the bonus token is drawn from the raw (unprocessed) distribution.
    decision_per_path: each root-to-leaf path verified on its own as a chain (independent
        randomness); the longest accepted path wins, the first path on ties (deterministic only).
    unremoved_siblings: children sampled without replacement verified with ``Q_k = q`` (earlier
        siblings not removed from q), i.e. with the with-replacement rule.
    """

    fresh_p_after_rejection: bool = False
    draft_softmax_as_q: bool = False
    reused_draft_noise: bool = False
    sorted_children: bool = False
    skip_duplicates: bool = False
    bonus_from_raw: bool = False
    decision_per_path: bool = False
    unremoved_siblings: bool = False


CORRECT = Rules()
NEGATIVE_CONTROLS = {
    "fresh_p_after_rejection": Rules(fresh_p_after_rejection=True),
    "draft_softmax_as_q": Rules(draft_softmax_as_q=True),
    "reused_draft_noise": Rules(reused_draft_noise=True),
    "sorted_children": Rules(sorted_children=True),
    "skip_duplicates": Rules(skip_duplicates=True),
    "bonus_from_raw": Rules(bonus_from_raw=True),
    "decision_per_path": Rules(decision_per_path=True),
    "unremoved_siblings": Rules(unremoved_siblings=True),
}


# ----------------------------------------------------------------------------- distributions


def dist(*weights) -> Dist:
    """Normalised distribution from non-negative weights (ints, Fractions or decimal strings)."""
    w = [Fraction(x) for x in weights]
    if any(x < 0 for x in w) or sum(w) == 0:
        raise ValueError(f"weights must be non-negative with positive mass, got {weights}")
    total = sum(w)
    return tuple(x / total for x in w)


def normalise(x: Sequence[Fraction]) -> Dist | None:
    mass = sum(x)
    return None if mass == 0 else tuple(v / mass for v in x)


def positive_part(r: Dist, q: Dist) -> Dist | None:
    """normalise(max(r - q, 0)); None when the mass is zero."""
    return normalise([max(a - b, ZERO) for a, b in zip(r, q, strict=True)])


def point_mass(y: int, vocab: int) -> Dist:
    return tuple(ONE if i == y else ZERO for i in range(vocab))


def argmax(d: Sequence[Fraction]) -> int:
    """Argmax with ties broken by the smallest token id."""
    return max(range(len(d)), key=lambda y: (d[y], -y))


def top_tokens(d: Sequence[Fraction], k: int) -> tuple[int, ...]:
    """The k most likely tokens, most likely first, ties by smallest id."""
    return tuple(sorted(range(len(d)), key=lambda y: (-d[y], y))[:k])


def top_k_dist(d: Dist, k: int) -> Dist:
    """Top-k filter as Hugging Face does it (ties with the k-th value kept), renormalised."""
    kth = sorted(d, reverse=True)[min(k, len(d)) - 1]
    return normalise([x if x >= kth else ZERO for x in d])


def random_dist(rng: random.Random, vocab: int, zero_chance: float = 0.3, max_weight: int = 4) -> Dist:
    """Small integer weights: ties are common and zeros appear with probability ``zero_chance``."""
    while True:
        w = [0 if rng.random() < zero_chance else rng.randint(1, max_weight) for _ in range(vocab)]
        if sum(w):
            return dist(*w)


def dist_table(seed: int, vocab: int, **kwargs) -> DistFn:
    """A target or draft "model": a fixed random distribution for every prefix, seeded."""

    @cache
    def fn(prefix: Prefix) -> Dist:
        return random_dist(random.Random(f"{seed}:{prefix}"), vocab, **kwargs)

    return fn


def constant(d: Dist) -> DistFn:
    return lambda prefix: d


def total_variation(a: dict, b: dict) -> Fraction:
    keys = set(a) | set(b)
    return sum((abs(a.get(k, ZERO) - b.get(k, ZERO)) for k in keys), ZERO) / 2


def marginal_first(law: dict) -> dict:
    out: dict = defaultdict(Fraction)
    for seq, pr in law.items():
        out[seq[:1]] += pr
    return dict(out)


# ----------------------------------------------------------------------------- one node's children


def proposal_laws(tokens: Sequence[int], q: Dist | None, kind: str, vocab: int) -> list[Dist]:
    """Q_k for each child k of a node whose children carry ``tokens`` in proposal order."""
    if kind in ("greedy", "deterministic"):
        return [point_mass(x, vocab) for x in tokens]
    if kind == "with_replacement":
        return [q] * len(tokens)
    laws, remaining = [], list(q)
    for x in tokens:
        law = normalise(remaining)
        if law is None:
            raise ValueError("more children than tokens with positive draft probability")
        laws.append(law)
        remaining[x] = ZERO
    return laws


def check_children(
    tokens: Sequence[int], p: Dist, q: Dist | None, kind: str, rules: Rules = CORRECT
) -> list[tuple[Fraction, int | None, Dist]]:
    """Exact outcomes of verifying the children of one node (docs/EXACTNESS.md, "The verification rules").

    tokens: the children's tokens in proposal order; p: the target at the node; q: the draft law the
    children were proposed from (None allowed for deterministic proposals).
    Returns ``[(probability, index of the accepted child, _)]`` and one ``(probability, None, law)``
    entry for "every child rejected", where ``law`` is the law of the correction token.
    """
    order = list(range(len(tokens)))
    if rules.sorted_children and kind in SAMPLED:
        order.sort(key=lambda k: -q[tokens[k]])  # stable: ties keep proposal order
    in_order = [tokens[k] for k in order]
    if kind == "deterministic" and rules.draft_softmax_as_q:
        laws = [q] * len(tokens)  # the classic bias: the softmax, not a point mass
    else:
        # Q_k in the order of verification (what code that re-sorted the children would compute)
        rule = "with_replacement" if rules.unremoved_siblings and kind == "without_replacement" else kind
        laws = proposal_laws(in_order, q, rule, len(p))

    outcomes: list[tuple[Fraction, int | None, Dist]] = []
    reach = ONE  # probability that verification gets to the current child
    r = p
    seen: set[int] = set()
    for step, k in enumerate(order):
        x = tokens[k]
        if rules.skip_duplicates and x in seen:
            continue
        seen.add(x)
        law = laws[step]
        target = p if rules.fresh_p_after_rejection else r
        if law[x] == 0 and kind in SAMPLED:
            raise ValueError(f"token {x} has probability zero under the law it was sampled from")
        ratio = ONE if law[x] == 0 else min(ONE, target[x] / law[x])  # draft softmax as q: p / 0 = inf
        if rules.reused_draft_noise and kind in SAMPLED:
            lo = sum(law[:x], ZERO)  # the child was drawn as x = F^-1(u), u uniform on [lo, lo + law[x])
            accept = min(max(ratio - lo, ZERO), law[x]) / law[x]
        else:
            accept = ratio
        if accept > 0:
            outcomes.append((reach * accept, k, ()))
        reach *= 1 - accept
        if reach == 0:
            return outcomes
        if not rules.fresh_p_after_rejection:
            r = positive_part(r, law)
            assert r is not None, "residual mass zero although rejection had positive probability"
    outcomes.append((reach, None, p if rules.fresh_p_after_rejection else r))
    return outcomes


# ----------------------------------------------------------------------------- a fixed tree


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {i: [] for i in range(-1, len(parents))}
    for i, par in enumerate(parents):
        kids[par].append(i)
    return kids


def verify_law(
    parents: Sequence[int],
    tokens: Sequence[int],
    p_rows: Sequence[Dist],
    q_rows: Sequence[Dist] | None,
    kind: str,
    rules: Rules = CORRECT,
    raw_rows: Sequence[Dist] | None = None,
) -> dict[tuple[tuple[int, ...], int], Fraction]:
    """Exact law of ``(accepted node indices, next token)`` for one fixed tree.

    Rows as in ``verify_tree``: row 0 at the root, row i + 1 after node i.
    """
    kids = children_of(parents)
    out: dict = defaultdict(Fraction)

    def emit(accepted: tuple[int, ...], law: Dist, prob: Fraction) -> None:
        for y, pr in enumerate(law):
            if pr:
                out[(accepted, y)] += prob * pr

    def visit(node: int, accepted: tuple[int, ...], prob: Fraction) -> None:
        row = node + 1
        if kind == "greedy":
            choice = argmax(p_rows[row])
            match = next((c for c in kids[node] if tokens[c] == choice), None)
            if match is None:
                out[(accepted, choice)] += prob
            else:
                visit(match, accepted + (match,), prob)
            return
        if not kids[node]:
            emit(accepted, raw_rows[row] if rules.bonus_from_raw else p_rows[row], prob)
            return
        q = None if q_rows is None else q_rows[row]
        for pr, k, law in check_children([tokens[c] for c in kids[node]], p_rows[row], q, kind, rules):
            if k is None:
                emit(accepted, law, prob * pr)
            else:
                child = kids[node][k]
                visit(child, accepted + (child,), prob * pr)

    visit(-1, (), ONE)
    return dict(out)


# ----------------------------------------------------------------------------- draft + verify + target


def target_law(target: DistFn, n_emit: int, greedy: bool = False, prefix: Prefix = ()) -> dict:
    """Law of the next ``n_emit`` tokens when the target samples alone (greedy: argmax chain)."""
    laws: dict = {(): ONE}
    for _ in range(n_emit):
        nxt: dict = defaultdict(Fraction)
        for seq, pr in laws.items():
            d = target(prefix + seq)
            if greedy:
                d = point_mass(argmax(d), len(d))
            for y, py in enumerate(d):
                if py:
                    nxt[seq + (y,)] += pr * py
        laws = dict(nxt)
    return laws


def draft_outcomes(q: Dist, n_children: int, kind: str) -> list[tuple[tuple[int, ...], Fraction]]:
    """All token tuples a draft can propose for ``n_children`` children, with exact probabilities.

    with_replacement: i.i.d. draws from q. without_replacement: sequential sampling without
    replacement (the law of Gumbel-top-k on log q, children in the order drawn); when q's support is
    exhausted the node simply has fewer children (the trailing ones are not proposed).
    """
    support = [y for y, w in enumerate(q) if w]
    if kind == "with_replacement":
        outs = []
        for combo in itertools.product(support, repeat=n_children):
            pr = ONE
            for y in combo:
                pr *= q[y]
            outs.append((combo, pr))
        return outs
    outs = []

    def rec(prefix: tuple[int, ...], remaining: list[Fraction], pr: Fraction) -> None:
        law = normalise(remaining)
        if len(prefix) == n_children or law is None:
            outs.append((prefix, pr))
            return
        for y, w in enumerate(law):
            if w:
                rest = list(remaining)
                rest[y] = ZERO
                rec(prefix + (y,), rest, pr * w)

    rec((), list(q), ONE)
    return outs


def materialise(shape: Sequence[int], token_fn: TokenFn) -> tuple[list[int], list[Prefix]]:
    """Tokens and prefixes (tokens from the root down, node included) of a deterministic tree."""
    kids = children_of(shape)
    tokens = [0] * len(shape)
    prefixes: list[Prefix] = [()] * len(shape)

    def fill(node: int, prefix: Prefix) -> None:
        if not kids[node]:
            return
        toks = token_fn(prefix, len(kids[node]))
        for c, t in zip(kids[node], toks, strict=True):
            tokens[c] = t
            prefixes[c] = prefix + (t,)
            fill(c, prefix + (t,))

    fill(-1, ())
    return tokens, prefixes


def emitted_law(
    kind: str,
    shape: Sequence[int],
    target: DistFn,
    n_emit: int = 2,
    draft: DistFn | None = None,
    token_fn: TokenFn | None = None,
    rules: Rules = CORRECT,
    raw: DistFn | None = None,
) -> dict[tuple[int, ...], Fraction]:
    """Exact law of the first ``n_emit`` emitted tokens of one round of speculation + plain sampling.

    shape: parent indices of the tree (tokens are filled in by the draft). target(prefix): the
    target's processed distribution after ``prefix``; draft(prefix): the draft's law there (sampled
    kinds). token_fn(prefix, k): the k tokens a deterministic draft proposes after ``prefix``
    (default: the k most likely under ``draft``, or under ``target`` when no draft is given). The
    emitted tokens are the accepted path and the next token, then fresh target samples.

    Subtrees are drafted lazily: given its token, a child's subtree is drafted with randomness of its
    own, so drafting it only when the child is accepted gives the same law as drafting all first.
    """
    if kind not in KINDS:
        raise ValueError(kind)
    greedy = kind == "greedy"
    if token_fn is None:
        guide = draft or target
        token_fn = lambda prefix, k: top_tokens(guide(prefix), k)
    if rules.decision_per_path:
        return _emitted_law_per_path(kind, shape, target, n_emit, token_fn)
    kids = children_of(shape)

    @cache
    def fresh(prefix: Prefix, need: int) -> dict:
        return target_law(target, need, greedy, prefix)

    def then_fresh(out: dict, y: int, prefix: Prefix, need: int, prob: Fraction) -> None:
        for seq, pr in fresh(prefix + (y,), need - 1).items():
            out[(y,) + seq] += prob * pr

    @cache
    def walk(node: int, prefix: Prefix, need: int) -> dict:
        """Law of the next ``need`` emitted tokens, ``node`` accepted (or the root) after ``prefix``."""
        out: dict = defaultdict(Fraction)
        if need == 0:
            return {(): ONE}
        p = target(prefix)
        children = kids[node]
        if greedy:
            choice = argmax(p)
            toks = token_fn(prefix, len(children)) if children else ()
            match = next((c for c, t in zip(children, toks, strict=True) if t == choice), None)
            if match is None:
                then_fresh(out, choice, prefix, need, ONE)
            else:
                for seq, pr in walk(match, prefix + (choice,), need - 1).items():
                    out[(choice,) + seq] += pr
            return dict(out)
        if not children:  # bonus
            for y, py in enumerate(raw(prefix) if rules.bonus_from_raw else p):
                if py:
                    then_fresh(out, y, prefix, need, py)
            return dict(out)
        if kind == "deterministic":
            proposals = [(tuple(token_fn(prefix, len(children))), ONE)]
            q = draft(prefix) if draft is not None else None
        else:
            q = draft(prefix)
            proposals = draft_outcomes(q, len(children), kind)
        for toks, pr_draft in proposals:
            for pr, k, law in check_children(toks, p, q, kind, rules):
                if k is None:  # correction
                    for y, py in enumerate(law):
                        if py:
                            then_fresh(out, y, prefix, need, pr_draft * pr * py)
                else:
                    y = toks[k]
                    for seq, ps in walk(children[k], prefix + (y,), need - 1).items():
                        out[(y,) + seq] += pr_draft * pr * ps
        return dict(out)

    return walk(-1, (), n_emit)


def _emitted_law_per_path(kind: str, shape, target: DistFn, n_emit: int, token_fn: TokenFn) -> dict:
    """Negative control: one target decision per root-to-leaf path, the longest accepted path wins."""
    if kind != "deterministic":
        raise ValueError("the per-path control is implemented for deterministic trees")
    tokens, prefixes = materialise(shape, token_fn)
    kids = children_of(shape)
    leaves = [i for i in range(len(shape)) if not kids[i]]
    path_laws = []
    for leaf in leaves:
        path, node = [], leaf
        while node != -1:
            path.append(node)
            node = shape[node]
        path.reverse()
        chain = list(range(-1, len(path) - 1))
        rows = [target(())] + [target(prefixes[i]) for i in path]
        law = verify_law(chain, [tokens[i] for i in path], rows, None, kind)
        # outcome: (number of accepted nodes, emitted tokens)
        path_laws.append(
            [((len(acc), tuple(tokens[path[i]] for i in acc) + (y,)), pr) for (acc, y), pr in law.items()]
        )
    out: dict = defaultdict(Fraction)
    for combo in itertools.product(*path_laws):
        prob = ONE
        for _, pr in combo:
            prob *= pr
        best = max(range(len(combo)), key=lambda j: (combo[j][0][0], -j))
        emitted = combo[best][0][1]
        if len(emitted) >= n_emit:
            out[emitted[:n_emit]] += prob
        else:
            for seq, pr in target_law(target, n_emit - len(emitted), False, emitted).items():
                out[emitted + seq] += prob * pr
    return dict(out)


# ----------------------------------------------------------------------------- mixed nodes
#
# A node whose children come from two proposers: point masses copied from the context beside
# children from the head (drawn from q, or the head's top-k). docs/EXACTNESS.md, "Mixed nodes".


@dataclass(frozen=True)
class MixedRules:
    """The correct mixed-node rule by default; each flag is a known wrong variant.

    context_as_q: the context child is verified as if drawn from q (Q_k = q with the earlier drawn
        siblings removed, and removed from q after it) instead of as a point mass.
    drop_drawn_duplicates: a drawn child that repeats a context token checked before it is dropped
        (not checked, no residual update).
    keep_point_mass_duplicates: a context child that repeats a head child checked before it is kept
        and checked (harmless: not a wrong rule, shown to change nothing).
    """

    context_as_q: bool = False
    drop_drawn_duplicates: bool = False
    keep_point_mass_duplicates: bool = False


MIXED_CORRECT = MixedRules()
MIXED_CONTROLS = {
    "context_as_q": MixedRules(context_as_q=True),
    "drop_drawn_duplicates": MixedRules(drop_drawn_duplicates=True),
}


def mixed_checks(context: Sequence[int], head: Sequence[int], kind: str, first: str,
                 rules: MixedRules = MIXED_CORRECT) -> list[tuple[int, bool]]:
    """The acceptance tests at a mixed node, in order: (token, drawn from q?).

    context: the context tokens (distinct, point masses); head: the head's children in proposal
    order (drawn from q for the sampled kinds, point masses for "deterministic"). A context token
    that repeats an earlier head child is a point-mass duplicate: dropped (it changes nothing). A
    head child that repeats an earlier context token is checked in its place if it was drawn, and
    dropped if it is a point mass."""
    drawn = kind in SAMPLED
    ctx = [(t, rules.context_as_q, "context") for t in context]
    hd = [(t, drawn, "head") for t in head]
    checks: list[tuple[int, bool]] = []
    seen: dict[int, str] = {}  # token -> the proposer of its first test
    for t, is_drawn, source in (ctx + hd if first == "context" else hd + ctx):
        if t in seen:
            if not is_drawn and not rules.keep_point_mass_duplicates:
                continue  # a point-mass duplicate: r(t) is zero already
            if is_drawn and source == "head" and seen[t] == "context" and rules.drop_drawn_duplicates:
                continue
        seen.setdefault(t, source)
        checks.append((t, is_drawn))
    return checks


def check_mixed(checks: Sequence[tuple[int, bool]], p: Dist, q: Dist | None, kind: str
                ) -> list[tuple[Fraction, int | None, Dist]]:
    """Exact outcomes of the tests ``checks`` at one node, each with its own law Q_k: a point mass,
    or q (with the earlier drawn tests removed for "without_replacement"). Same output as
    ``check_children``: ``[(probability, index of the accepted test or None, correction law)]``."""
    vocab = len(p)
    outcomes: list[tuple[Fraction, int | None, Dist]] = []
    reach, r = ONE, p
    remaining = None if q is None else list(q)
    for i, (x, drawn) in enumerate(checks):
        if drawn:
            law = normalise(remaining) if kind == "without_replacement" else q
            if law is None:
                law = tuple(ZERO for _ in range(vocab))
        else:
            law = point_mass(x, vocab)
        accept = ONE if law[x] == 0 else min(ONE, r[x] / law[x])  # q(x) = 0 only for a wrong rule
        if accept > 0:
            outcomes.append((reach * accept, i, ()))
        reach *= 1 - accept
        if reach == 0:
            return outcomes
        r = positive_part(r, law)
        assert r is not None, "residual mass zero although rejection had positive probability"
        if drawn and kind == "without_replacement":
            remaining[x] = ZERO
    outcomes.append((reach, None, r))
    return outcomes


def mixed_emitted_law(
    kind: str,
    target: DistFn,
    draft: DistFn,
    context: Callable[[Prefix], Sequence[int]],
    width: Callable[[Prefix], int],
    depth: int,
    n_emit: int = 2,
    first: str = "context",
    rules: MixedRules = MIXED_CORRECT,
) -> dict[tuple[int, ...], Fraction]:
    """Exact law of the first ``n_emit`` emitted tokens when every node down to ``depth`` gets the
    context tokens ``context(prefix)`` (point masses) and ``width(prefix)`` head children (drawn
    from ``draft(prefix)`` by ``kind``, or its top tokens for "deterministic"), merged as a trie,
    verified by ``mixed_checks`` / ``check_mixed``, then the target continues alone."""
    if kind not in ("deterministic", *SAMPLED):
        raise ValueError(kind)

    @cache
    def fresh(prefix: Prefix, need: int) -> dict:
        return target_law(target, need, False, prefix)

    @cache
    def walk(prefix: Prefix, level: int, need: int) -> dict:
        out: dict = defaultdict(Fraction)
        if need == 0:
            return {(): ONE}
        p = target(prefix)
        ctx = list(context(prefix)) if level < depth else []
        k = width(prefix) if level < depth else 0
        q = draft(prefix)
        if kind == "deterministic":
            heads = [(tuple(top_tokens(q, k)), ONE)]
        else:
            heads = draft_outcomes(q, k, kind) if k else [((), ONE)]
        for head, pr_draft in heads:
            checks = mixed_checks(ctx, head, kind, first, rules)
            if not checks:  # an accepted leaf: the bonus token
                for y, py in enumerate(p):
                    if py:
                        for seq, pr in fresh(prefix + (y,), need - 1).items():
                            out[(y,) + seq] += pr_draft * py * pr
                continue
            for pr, i, law in check_mixed(checks, p, q, kind):
                if i is None:
                    for y, py in enumerate(law):
                        if py:
                            for seq, ps in fresh(prefix + (y,), need - 1).items():
                                out[(y,) + seq] += pr_draft * pr * py * ps
                else:
                    y = checks[i][0]
                    for seq, ps in walk(prefix + (y,), level + 1, need - 1).items():
                        out[(y,) + seq] += pr_draft * pr * ps
        return dict(out)

    return walk((), 0, n_emit)
