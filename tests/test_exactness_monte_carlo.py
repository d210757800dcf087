"""Exactness by seeded Monte Carlo on the real tensor verifier (docs/EXACTNESS.md, "Claims and the tests").

One round of speculation: a draft proposes a chain or a tree over a tiny vocabulary (its randomness
from its own generator), ``eagle_tree.verify_tree`` accepts a path and emits one more token (its
randomness from another generator), and when fewer than two tokens came out, the target samples the
second one itself (a third generator). The first emitted token and the joint of the first two are
compared with the target's law by a chi-square test.

Statistics. Each chi-square test uses significance ALPHA = 1e-6. About 70 of them run in this file
(first token and joint, real verifier and negative-control twins). Bonferroni: the family-wise false
alarm rate is below 70 * 1e-6 = 7e-5; the seeds are fixed, so a pass is reproducible and a failure
is a real deviation or a 7e-5 accident.

Power argument (for N = 20_000 trials and a total variation error TV >= 0.03). For expected cell
probabilities p0 and true ones p1 = p0 + d, Pearson's statistic is approximately noncentral
chi-square with noncentrality lambda = N * sum(d^2 / p0). By Cauchy-Schwarz,
(sum |d|)^2 <= sum(d^2 / p0) * sum(p0), so lambda >= N * (2 TV)^2 = 20_000 * 0.0036 = 72 whatever the
direction of the error. With V = 4 tokens the joint of two tokens has at most 16 cells (df <= 15):
P(reject) >= P(ncx2(15, 72) > chi2.isf(1e-6, 15) = 56.5) = 0.968; for the first token (df <= 3)
it is 0.999. (Cells of expected count < 5, i.e. probability < 2.5e-4, are pooled: that can hide at
most a negligible part of a 0.03 error.) ``test_power_of_the_checks`` recomputes these numbers and
``test_checker_detects_tv_0_03`` shows it empirically. The negative controls use fewer trials
(N_CONTROL), which only makes rejecting them harder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats

from eagle_tree import SamplingConfig, Tree, processed_probs, verify_tree
from tests.exact_reference import (
    NEGATIVE_CONTROLS,
    children_of,
    emitted_law,
    target_law,
    total_variation,
    verify_law,
)

V = 4  # vocabulary of the Monte Carlo models
DEPTH = 3  # prefixes up to this length have their own distributions
N = 20_000
N_CONTROL = 5_000
ALPHA = 1e-6
TV_TO_DETECT = 0.03

SHAPES = {
    "chain": [-1, 0, 1],
    "tree": [-1, -1, -1, 0, 0, 1, 3],  # root: 3 children; node 0: 2; node 1: 1; node 3: 1 (depth 3)
}
SETTINGS = {
    "t1.0": SamplingConfig(temperature=1.0),
    "t0.7": SamplingConfig(temperature=0.7),
    "t1.0-topk3": SamplingConfig(temperature=1.0, top_k=3),
    "t0.7-topp0.8": SamplingConfig(temperature=0.7, top_p=0.8),
    "t0.7-topk3-topp0.9": SamplingConfig(temperature=0.7, top_k=3, top_p=0.9),
}

# A verifier gets (parents, tokens, target rows (n+1, V), draft rows (n+1, V), prefix ids of the
# rows, proposal kind, generator) and returns the emitted tokens: accepted path, then the next token.
Verifier = Callable[..., list[int]]


def real_verifier(parents, tokens, p_rows, q_rows, rows, kind, gen) -> list[int]:
    res = verify_tree(Tree(parents, tokens), p_rows, q_rows, kind, gen)
    return [tokens[i] for i in res.accepted] + [res.next_token]


# ----------------------------------------------------------------------------- models over prefixes


def prefix_id(parent_id, token):
    """Bijective base-V numbering of prefixes: () -> 0, (t,) -> t + 1, s + (t,) -> id(s) * V + t + 1."""
    return parent_id * V + token + 1


TABLE_SIZE = sum(V**d for d in range(DEPTH + 1))


def random_model(seed: int, sampling: SamplingConfig, draft_noise: float = 1.0, scale: float = 1.0):
    """Target and draft distributions for every prefix: processed_probs of random logits, (S, V) each.

    The draft's logits are the target's plus noise (draft_noise = 0: p == q)."""
    g = torch.Generator().manual_seed(seed)
    logits_p = torch.randn(TABLE_SIZE, V, generator=g) * scale
    logits_q = logits_p + draft_noise * torch.randn(TABLE_SIZE, V, generator=g)
    return processed_probs(logits_p, sampling), processed_probs(logits_q, sampling), logits_p


def constant_model(p: Sequence[float], q: Sequence[float]):
    """The same p and q after every prefix (vocabulary len(p) <= V, padded with zeros)."""
    pad = lambda d: torch.tensor(list(d) + [0.0] * (V - len(d)), dtype=torch.float32)
    return pad(p).expand(TABLE_SIZE, V).clone(), pad(q).expand(TABLE_SIZE, V).clone()


# ----------------------------------------------------------------------------- one round, many times


def draft_trees(shape, kind, q_table, n_trials, gen):
    """Vectorised drafting of n_trials trees of one shape. Returns tokens, prefix ids, valid: (N, n).

    deterministic/greedy: the top-k tokens of q (ties by smallest id); with_replacement: i.i.d. from
    q; without_replacement: Gumbel-top-k on log q, children in decreasing perturbed score (the order
    sequential sampling would draw them). A child with perturbed score -inf does not exist (q's
    support was exhausted): it is marked invalid with its subtree.
    """
    n = len(shape)
    kids = children_of(shape)
    tokens = torch.zeros(n_trials, n, dtype=torch.long)
    ids = torch.zeros(n_trials, n, dtype=torch.long)
    valid = torch.ones(n_trials, n, dtype=torch.bool)
    for parent in [-1, *range(n)]:
        ch = kids[parent]
        if not ch:
            continue
        pid = torch.zeros(n_trials, dtype=torch.long) if parent == -1 else ids[:, parent]
        q = q_table[pid].double()  # (N, V)
        ok = torch.ones(n_trials, len(ch), dtype=torch.bool)
        if kind == "with_replacement":
            tok = torch.multinomial(q, len(ch), replacement=True, generator=gen)
        elif kind == "without_replacement":
            u = torch.rand(n_trials, V, generator=gen, dtype=torch.float64)
            top = (q.log() - (-u.log()).log()).topk(len(ch), dim=-1)
            tok, ok = top.indices, top.values > float("-inf")
        else:
            tok = torch.sort(q, dim=-1, descending=True, stable=True).indices[:, : len(ch)]
        tokens[:, ch] = tok
        ids[:, ch] = prefix_id(pid[:, None], tok)
        valid[:, ch] = ok if parent == -1 else ok & valid[:, parent : parent + 1]
    return tokens, ids, valid


def compact(shape, tokens, ids, valid):
    """Drop invalid nodes (and renumber parents) for one trial."""
    keep = [i for i in range(len(shape)) if valid[i]]
    new = {old: j for j, old in enumerate(keep)}
    parents = [-1 if shape[i] == -1 else new[shape[i]] for i in keep]
    return parents, [tokens[i] for i in keep], [ids[i] for i in keep]


def run_rounds(shape, kind, p_table, q_table, n_trials, seed, verifier: Verifier = real_verifier):
    """Emitted first two tokens of n_trials independent rounds: (N, 2) int64."""
    g_draft = torch.Generator().manual_seed(seed)
    g_verify = torch.Generator().manual_seed(seed + 1)
    g_target = torch.Generator().manual_seed(seed + 2)
    tokens, ids, valid = draft_trees(shape, kind, q_table, n_trials, g_draft)
    rows = torch.cat([torch.zeros(n_trials, 1, dtype=torch.long), ids], dim=1)
    p_rows, q_rows = p_table[rows], q_table[rows]  # (N, n + 1, V)
    all_valid = valid.all(dim=1).tolist()
    tokens_l, rows_l = tokens.tolist(), rows.tolist()
    first_two = torch.full((n_trials, 2), -1, dtype=torch.long)
    for t in range(n_trials):
        if all_valid[t]:
            out = verifier(shape, tokens_l[t], p_rows[t], q_rows[t], rows_l[t], kind, g_verify)
        else:
            par, tok, idl = compact(shape, tokens_l[t], rows_l[t][1:], valid[t].tolist())
            r = [0, *idl]
            out = verifier(par, tok, p_table[r], q_table[r], r, kind, g_verify)
        first_two[t, : min(2, len(out))] = torch.tensor(out[:2])
    need = first_two[:, 1] < 0  # only one token came out: the target samples the second itself
    if need.any():
        cont = p_table[prefix_id(0, first_two[need, 0])].double()
        first_two[need, 1] = torch.multinomial(cont, 1, generator=g_target).squeeze(1)
    return first_two


def target_laws(p_table):
    """Exact (float64) laws of the first token (V,) and of the first two tokens (V, V)."""
    p = p_table.double()
    first = p[0]
    joint = first[:, None] * p[prefix_id(0, torch.arange(V))]
    return first, joint


# ----------------------------------------------------------------------------- the checker


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells of probability 0 must stay empty (else p = 0).

    Cells with expected count below 5 are pooled into one cell."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(counts) < 2:
        return 1.0
    return float(stats.chisquare(counts, expected).pvalue)


def law_pvalues(first_two: torch.Tensor, p_table: torch.Tensor) -> tuple[float, float]:
    """p-values of the first emitted token and of the joint of the first two against the target."""
    first, joint = target_laws(p_table)
    ft = first_two.numpy()
    c1 = np.bincount(ft[:, 0], minlength=V)
    c2 = np.bincount(ft[:, 0] * V + ft[:, 1], minlength=V * V)
    return chi_square_pvalue(c1, first.numpy()), chi_square_pvalue(c2, joint.numpy())


def test_power_of_the_checks():
    lam = N * (2 * TV_TO_DETECT) ** 2
    assert stats.ncx2.sf(stats.chi2.isf(ALPHA, V * V - 1), V * V - 1, lam) > 0.95
    assert stats.ncx2.sf(stats.chi2.isf(ALPHA, V - 1), V - 1, lam) > 0.99


def test_checker_detects_tv_0_03():
    """Empirical power: samples from a law at total variation 0.03 from the target are rejected."""
    p_table, _, _ = random_model(0, SETTINGS["t1.0"])
    _, joint = target_laws(p_table)
    joint = joint.numpy().ravel()
    rng = np.random.default_rng(0)
    rejected = 0
    for _ in range(5):
        lo, hi = rng.choice(np.flatnonzero(joint > TV_TO_DETECT), size=2, replace=False)
        shifted = joint.copy()
        shifted[lo] -= TV_TO_DETECT  # move 0.03 of mass between two cells: TV exactly 0.03
        shifted[hi] += TV_TO_DETECT
        counts = rng.multinomial(N, shifted)
        rejected += chi_square_pvalue(counts, joint) < ALPHA
        assert chi_square_pvalue(rng.multinomial(N, joint), joint) > ALPHA  # the target itself passes
    assert rejected >= 4
    impossible = np.zeros(V * V)
    impossible[0] = 1
    assert chi_square_pvalue(impossible, np.r_[0.0, np.full(V * V - 1, 1 / 15)]) == 0.0


# ----------------------------------------------------------------------------- the real verifier

CORE = [
    ("chain", "deterministic", "t0.7"),
    ("tree", "deterministic", "t1.0-topk3"),
    ("chain", "with_replacement", "t1.0-topk3"),
    ("tree", "with_replacement", "t0.7-topp0.8"),
    ("chain", "without_replacement", "t0.7-topp0.8"),
    ("tree", "without_replacement", "t0.7"),
]
EXTENDED = [
    ("chain", "deterministic", "t0.7-topk3-topp0.9"),
    ("tree", "deterministic", "t0.7-topp0.8"),
    ("chain", "with_replacement", "t1.0"),
    ("tree", "with_replacement", "t0.7-topk3-topp0.9"),
    ("chain", "without_replacement", "t1.0-topk3"),
    ("tree", "without_replacement", "t0.7-topk3-topp0.9"),
]


def case_seed(shape, kind, setting) -> int:
    case = (shape, kind, setting)
    return CORE.index(case) if case in CORE else 50 + EXTENDED.index(case)


def _check_real(shape, kind, setting, seed):
    p_table, q_table, _ = random_model(seed, SETTINGS[setting])
    first_two = run_rounds(SHAPES[shape], kind, p_table, q_table, N, seed=100 + seed)
    p_first, p_joint = law_pvalues(first_two, p_table)
    assert p_first > ALPHA, f"first token: p = {p_first:.3g}"
    assert p_joint > ALPHA, f"first two tokens: p = {p_joint:.3g}"


def exact_model(table: torch.Tensor):
    """The float table as an exact model for tests/exact_reference.py (rows renormalised in Fractions)."""
    rows = [[Fraction(float(x)) for x in row] for row in table.tolist()]
    rows = [tuple(x / sum(row) for x in row) for row in rows]

    def model(prefix):
        i = 0
        for t in prefix:
            i = prefix_id(i, t)
        return rows[i]

    return model


@pytest.mark.parametrize("shape, kind, setting", CORE + EXTENDED)
def test_monte_carlo_cases_are_exact_and_sensitive(shape, kind, setting):
    """On the very models of the Monte Carlo cases, the exact enumeration holds, and wrong rules
    move the law of the first two tokens by TV >= 0.03, the size the chi-square check detects."""
    p_table, q_table, _ = random_model(case_seed(shape, kind, setting), SETTINGS[setting])
    target, draft = exact_model(p_table), exact_model(q_table)
    expected = target_law(target, 2)
    assert emitted_law(kind, SHAPES[shape], target, 2, draft=draft) == expected
    second = "draft_softmax_as_q" if kind == "deterministic" else "sorted_children"
    tv = {}
    for c in ("fresh_p_after_rejection", second):
        wrong = emitted_law(kind, SHAPES[shape], target, 2, draft=draft, rules=NEGATIVE_CONTROLS[c])
        tv[c] = total_variation(wrong, expected)
    print({c: round(float(v), 3) for c, v in tv.items()})
    assert max(tv.values()) >= TV_TO_DETECT


@pytest.mark.parametrize("shape, kind, setting", CORE)
def test_real_verifier_preserves_the_target_law(shape, kind, setting):
    _check_real(shape, kind, setting, seed=case_seed(shape, kind, setting))


@pytest.mark.slow
@pytest.mark.parametrize("shape, kind, setting", EXTENDED)
def test_real_verifier_preserves_the_target_law_more_settings(shape, kind, setting):
    _check_real(shape, kind, setting, seed=case_seed(shape, kind, setting))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("setting", ["t1.0", "t0.7-topp0.8"])
def test_greedy_emits_the_target_greedy_tokens(shape, setting):
    """Greedy: the target is a point mass, so every round must emit exactly its argmax chain.

    The tree's tokens are uniform at random so that matches and mismatches both occur; the target's
    probabilities are processed with ``setting`` and then with temperature 0."""
    _, _, logits = random_model(7, SETTINGS[setting])
    greedy_table = processed_probs(processed_probs(logits, SETTINGS[setting]).log(), SamplingConfig(0.0))
    assert torch.equal(greedy_table, processed_probs(logits, SamplingConfig(0.0)))  # argmax survives warpers
    uniform = torch.full((TABLE_SIZE, V), 1 / V)
    g = torch.Generator().manual_seed(8)
    tokens, ids, _ = draft_trees(SHAPES[shape], "with_replacement", uniform, 500, g)
    greedy_tokens, row = [], 0  # the target's own greedy continuation, DEPTH + 1 tokens
    for _ in range(DEPTH + 1):
        greedy_tokens.append(int(greedy_table[row].argmax()))
        row = prefix_id(row, greedy_tokens[-1]) if len(greedy_tokens) <= DEPTH else None
    accepted_lengths = set()
    for t in range(len(tokens)):
        rows = [0, *ids[t].tolist()]
        toks = tokens[t].tolist()
        res = verify_tree(Tree(SHAPES[shape], toks), greedy_table[rows], None, "greedy", None)
        emitted = [toks[i] for i in res.accepted] + [res.next_token]
        assert emitted == greedy_tokens[: len(emitted)]
        accepted_lengths.add(len(res.accepted))
    assert len(accepted_lengths) >= 3  # the test saw rejections at several depths


@pytest.mark.parametrize("kind", ["deterministic", "with_replacement", "without_replacement"])
def test_conditional_law_of_one_tree_matches_the_reference(kind):
    """Given one fixed tree, the law of (accepted path, next token) of ``verify_tree`` equals the
    exact reference's (tests/exact_reference.py), cell by cell: a check of the implementation itself,
    not only of the marginal laws. N = 20_000; up to ~30 cells, power for TV 0.03 >= 0.9."""
    p_table, q_table, _ = random_model(21, SETTINGS["t1.0"], draft_noise=0.7, scale=1.0)
    shape = [-1, -1, 0, 0, 1]
    n_kinds = {"deterministic": 0, "with_replacement": 1, "without_replacement": 2}
    tokens, ids, valid = draft_trees(shape, kind, q_table, 1, torch.Generator().manual_seed(n_kinds[kind]))
    assert bool(valid.all())
    tokens = tokens[0].tolist()
    rows = [0, *ids[0].tolist()]
    p_rows, q_rows = p_table[rows], q_table[rows]
    to_fraction = lambda m: [tuple(Fraction(float(x)) for x in row) for row in m.tolist()]
    law = verify_law(shape, tokens, to_fraction(p_rows), to_fraction(q_rows), kind)
    cells = sorted(law)
    g = torch.Generator().manual_seed(31)
    counts = np.zeros(len(cells))
    index = {c: i for i, c in enumerate(cells)}
    for _ in range(N):
        res = verify_tree(Tree(shape, tokens), p_rows, q_rows, kind, g)
        counts[index[(tuple(res.accepted), res.next_token)]] += 1  # KeyError: an impossible outcome
    probs = np.array([float(law[c]) for c in cells])
    assert stats.chi2.isf(ALPHA, len(cells) - 1) < stats.ncx2.isf(0.1, len(cells) - 1, N * 0.0036)
    assert chi_square_pvalue(counts, probs) > ALPHA


def test_expected_committed_tokens_of_a_chain():
    """Chain of g = 3 sampled proposals with the worked example's p and q at every position: each
    node is accepted with probability a = 0.6 independently, so E[committed] = (1 - a^4) / (1 - a)
    = 2.176. With N = 20_000 rounds the standard error is about 0.0075 (committed tokens in 1..4,
    standard deviation about 1.06); the tolerance 0.04 is more than 5 standard errors."""
    p_table, q_table = constant_model([0.5, 0.3, 0.2], [0.2, 0.2, 0.6])
    a, g = 0.6, 3
    expected = (1 - a ** (g + 1)) / (1 - a)
    assert expected == pytest.approx(2.176)
    committed = []

    def counting_verifier(parents, tokens, p_rows, q_rows, rows, kind, gen):
        res = verify_tree(Tree(parents, tokens), p_rows, q_rows, kind, gen)
        committed.append(len(res.accepted) + 1)
        return [tokens[i] for i in res.accepted] + [res.next_token]

    run_rounds(SHAPES["chain"], "with_replacement", p_table, q_table, N, seed=5, verifier=counting_verifier)
    mean = float(np.mean(committed))
    assert abs(mean - expected) < 0.04, mean
    survival = [np.mean(np.array(committed) > i) for i in range(1, g + 1)]  # Pr(accepted >= i) = a^i
    assert survival == pytest.approx([a, a**2, a**3], abs=0.02)


# ----------------------------------------------------------------------------- negative controls
#
# Each wrong rule is implemented here, around the real verifier where possible, and the same
# chi-square check must reject it. Each case is also run with the real verifier (its twin) and
# must pass there, so the rejection is due to the rule and not to the case.

P_EX, Q_EX = [0.5, 0.3, 0.2], [0.2, 0.2, 0.6]  # the worked example


def verify_fresh_p_after_rejection(parents, tokens, p_rows, q_rows, rows, kind, gen) -> list[int]:
    """Wrong: no residual; every child is tested against p and the correction is a fresh p sample."""
    kids = children_of(parents)
    out, node = [], -1
    while True:
        p, q = p_rows[node + 1].double(), q_rows[node + 1].double()
        if not kids[node]:
            return out + [int(torch.multinomial(p, 1, generator=gen))]
        for c in kids[node]:
            x = tokens[c]
            if torch.rand((), generator=gen, dtype=torch.float64) < p[x] / q[x]:
                out.append(x)
                node = c
                break
        else:
            return out + [int(torch.multinomial(p, 1, generator=gen))]


def verify_draft_softmax_as_q(parents, tokens, p_rows, q_rows, rows, kind, gen) -> list[int]:
    """Wrong: deterministic (top-k) proposals verified as if sampled from the draft's softmax."""
    assert kind == "deterministic"
    return real_verifier(parents, tokens, p_rows, q_rows, rows, "with_replacement", gen)


def verify_sorted_children(parents, tokens, p_rows, q_rows, rows, kind, gen) -> list[int]:
    """Wrong: sampled children re-sorted by q (descending) before verification (leaf children only)."""
    assert all(par == -1 for par in parents)
    q = q_rows[0]
    order = sorted(range(len(tokens)), key=lambda i: -float(q[tokens[i]]))
    return real_verifier(parents, [tokens[i] for i in order], p_rows, q_rows, rows, kind, gen)


def verify_skip_duplicates(parents, tokens, p_rows, q_rows, rows, kind, gen) -> list[int]:
    """Wrong: a child repeating an earlier sibling's token is dropped instead of checked (leaf children)."""
    assert all(par == -1 for par in parents)
    keep = [i for i in range(len(tokens)) if tokens[i] not in tokens[:i]]
    sub = [0] + [i + 1 for i in keep]
    toks = [tokens[i] for i in keep]
    return real_verifier([-1] * len(keep), toks, p_rows[sub], q_rows[sub], None, kind, gen)


def verify_one_decision_per_path(parents, tokens, p_rows, q_rows, rows, kind, gen) -> list[int]:
    """Wrong: each root-to-leaf path verified as its own chain; the longest accepted path wins."""
    kids = children_of(parents)
    best = None
    for leaf in (i for i in range(len(parents)) if not kids[i]):
        path, node = [], leaf
        while node != -1:
            path.append(node)
            node = parents[node]
        path.reverse()
        sub = [0] + [i + 1 for i in path]
        toks = [tokens[i] for i in path]
        out = real_verifier(list(range(-1, len(path) - 1)), toks, p_rows[sub], q_rows[sub], None, kind, gen)
        if best is None or len(out) > len(best):
            best = out
    return best


def verify_unremoved_siblings(parents, tokens, p_rows, q_rows, rows, kind, gen) -> list[int]:
    """Wrong: children sampled without replacement verified as if i.i.d. (q not renormalised)."""
    assert kind == "without_replacement"
    return real_verifier(parents, tokens, p_rows, q_rows, rows, "with_replacement", gen)


def make_bonus_from_raw(raw_table: torch.Tensor) -> Verifier:
    """Wrong: the bonus token at an accepted leaf is drawn from the raw (unprocessed) softmax."""

    def verify(parents, tokens, p_rows, q_rows, rows, kind, gen) -> list[int]:
        kids = children_of(parents)
        p_rows = p_rows.clone()
        for i in range(len(parents)):
            if not kids[i]:
                p_rows[i + 1] = raw_table[rows[i + 1]]  # leaf rows are only used for the bonus
        return real_verifier(parents, tokens, p_rows, q_rows, rows, kind, gen)

    return verify


def run_reused_noise(p_table, q_table, n_trials, seed, reuse: bool) -> torch.Tensor:
    """Chain of 2 children sampled by inverse CDF of q; with ``reuse`` the verifier's generator is a
    copy of the draft's, so each acceptance test reuses the uniform that drew its child."""
    g_draft = torch.Generator().manual_seed(seed)
    g_other = torch.Generator().manual_seed(seed + 1)
    g_target = torch.Generator().manual_seed(seed + 2)
    cdf = q_table.double().cumsum(dim=-1)
    out = torch.zeros(n_trials, 2, dtype=torch.long)
    for t in range(n_trials):
        g_verify = g_other
        if reuse:
            g_verify = torch.Generator()
            g_verify.set_state(g_draft.get_state())
        row, tokens, rows = 0, [], [0]
        for _ in range(2):
            u = torch.rand((), generator=g_draft, dtype=torch.float64)
            x = min(int(torch.searchsorted(cdf[row], u, right=True)), V - 1)
            tokens.append(x)
            row = prefix_id(row, x)
            rows.append(row)
        p_rows, q_rows = p_table[rows], q_table[rows]
        emitted = real_verifier([-1, 0], tokens, p_rows, q_rows, rows, "with_replacement", g_verify)
        if len(emitted) < 2:
            cont = p_table[prefix_id(0, emitted[0])].double()
            emitted.append(int(torch.multinomial(cont, 1, generator=g_target)))
        out[t] = torch.tensor(emitted[:2])
    return out


def _bonus_case():
    """Raw softmax (0.5, 0.3, 0.2) at every position, processed with temperature 0.5 to
    (0.66, 0.24, 0.11): same support, so only the chi-square (not an impossible cell) can catch it."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 0.0])).expand(TABLE_SIZE, V)
    p_table = processed_probs(logits, SamplingConfig(temperature=0.5))
    return p_table, p_table.clone(), logits.softmax(-1)


CONTROLS = {
    # name: (shape, kind, model, wrong verifier)
    "fresh_p_after_rejection": ([-1, 0], "with_replacement", lambda: constant_model(P_EX, Q_EX),
                                verify_fresh_p_after_rejection),
    "draft_softmax_as_q": ([-1, 0], "deterministic", lambda: constant_model(P_EX, Q_EX),
                           verify_draft_softmax_as_q),
    "sorted_children": ([-1, -1, -1], "with_replacement", lambda: constant_model(P_EX, Q_EX),
                        verify_sorted_children),
    "skip_duplicates": ([-1, -1, -1], "with_replacement", lambda: constant_model(P_EX, Q_EX),
                        verify_skip_duplicates),
    "decision_per_path": ([-1, -1, 0, 1], "deterministic", lambda: constant_model(P_EX, P_EX),
                          verify_one_decision_per_path),
    "bonus_from_raw": ([-1], "deterministic", lambda: _bonus_case()[:2],
                       make_bonus_from_raw(_bonus_case()[2])),
    "unremoved_siblings": ([-1, -1], "without_replacement", lambda: constant_model(P_EX, Q_EX),
                           verify_unremoved_siblings),
}


def _rejected(first_two, p_table) -> bool:
    p_first, p_joint = law_pvalues(first_two, p_table)
    return min(p_first, p_joint) < ALPHA


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_negative_control_is_rejected(control):
    shape, kind, model, wrong = CONTROLS[control]
    p_table, q_table = model()
    seed = 300 + sorted(CONTROLS).index(control)
    assert not _rejected(run_rounds(shape, kind, p_table, q_table, N_CONTROL, seed), p_table)
    assert _rejected(run_rounds(shape, kind, p_table, q_table, N_CONTROL, seed, verifier=wrong), p_table)


def test_negative_control_reused_draft_noise_is_rejected():
    p_table, q_table = constant_model(P_EX, Q_EX)
    assert not _rejected(run_reused_noise(p_table, q_table, N_CONTROL, 400, reuse=False), p_table)
    assert _rejected(run_reused_noise(p_table, q_table, N_CONTROL, 400, reuse=True), p_table)
