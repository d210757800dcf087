"""Property-based tests of verify_tree over random trees, distributions and sampling settings.

Invariants that hold for every input, chain or tree, every proposal kind:
- the accepted nodes form one root-to-node path;
- every accepted token, and the next token, has non-zero target probability where it was emitted;
- nothing raises, divides by zero or returns NaN (the result is a valid token id).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_tree import SamplingConfig, Tree, processed_probs, verify_tree
from eagle_tree.core.verify import VerifyRule

SETTINGS = settings(
    max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def distributions(draw, vocab: int, greedy: bool) -> torch.Tensor:
    """One row: processed_probs of random logits under random settings, or a raw law with zeros."""
    if greedy or draw(st.booleans()):
        logits = torch.tensor(draw(st.lists(st.floats(-8, 8, width=32), min_size=vocab, max_size=vocab)))
        if draw(st.booleans()):  # masked tokens
            masked = draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab))
            logits[torch.tensor(masked)] = float("-inf")
            if bool(torch.isinf(logits).all()):
                logits[draw(st.integers(0, vocab - 1))] = 0.0
        sampling = SamplingConfig(
            temperature=0.0 if greedy else draw(st.sampled_from([0.3, 0.7, 1.0, 1.5])),
            top_k=draw(st.sampled_from([0, 1, 2, 3])),
            top_p=draw(st.sampled_from([0.3, 0.8, 0.95, 1.0])),
        )
        return processed_probs(logits, sampling)
    weights = draw(st.lists(st.integers(0, 3), min_size=vocab, max_size=vocab).filter(any))
    w = torch.tensor(weights, dtype=torch.float32)
    return w / w.sum()


@st.composite
def cases(draw, structure: str, proposals: tuple[str, ...] = tuple(VerifyRule)):
    """(parents, tokens, target_probs, draft_probs, proposal, seed) for a valid verify_tree call."""
    proposal = draw(st.sampled_from(proposals))
    n = draw(st.integers(1, 8))
    if structure == "chain":
        parents = list(range(-1, n - 1))
    else:
        parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tree = Tree(parents, [0] * n)
    widest = max(len(kids) for kids in tree.children.values())
    # without replacement, a node cannot have more children than there are tokens
    vocab = draw(st.integers(max(2, widest) if proposal == "without_replacement" else 2, 6 + widest // 2))
    greedy = proposal == "greedy"
    p = torch.stack([draw(distributions(vocab, greedy)) for _ in range(n + 1)])
    q = torch.stack([draw(distributions(vocab, False)) for _ in range(n + 1)])
    if draw(st.booleans()):
        q = p.clone()  # alpha = 1
    tokens = [0] * n
    for node in range(-1, n):
        kids = tree.children[node]
        if not kids:
            continue
        row = q[node + 1]
        if proposal == "without_replacement" and int((row > 0).sum()) < len(kids):
            row = 0.5 * row + 0.5 / vocab  # enough support for distinct siblings
            q[node + 1] = row
        support = torch.nonzero(row > 0).flatten().tolist()
        if proposal == "with_replacement":
            toks = [draw(st.sampled_from(support)) for _ in kids]
        elif proposal == "without_replacement":
            toks = draw(st.permutations(support))[: len(kids)]
        else:  # deterministic / greedy: any tokens, duplicates and impossible ones included
            toks = [draw(st.integers(0, vocab - 1)) for _ in kids]
        for c, t in zip(kids, toks, strict=True):
            tokens[c] = t
    draft = None if proposal in ("greedy", "deterministic") and draw(st.booleans()) else q
    return parents, tokens, p, draft, proposal, draw(st.integers(0, 2**32 - 1))


def check_invariants(parents, tokens, p, result):
    assert isinstance(result.next_token, int) and 0 <= result.next_token < p.shape[1]
    previous = -1
    for node in result.accepted:
        assert 0 <= node < len(parents)
        assert parents[node] == previous, "accepted nodes must form one root-to-node path"
        assert p[previous + 1, tokens[node]] > 0, "accepted a token the target cannot emit"
        previous = node
    assert p[previous + 1, result.next_token] > 0, "next token has zero target probability"


def run(parents, tokens, p, q, proposal, seed):
    g = torch.Generator().manual_seed(seed)
    result = verify_tree(Tree(parents, tokens), p, q, proposal, g)
    check_invariants(parents, tokens, p, result)
    return result


@SETTINGS
@given(cases("chain"))
def test_invariants_chain(case):
    run(*case)


@SETTINGS
@given(cases("tree"))
def test_invariants_tree(case):
    run(*case)


@SETTINGS
@given(st.sampled_from(["chain", "tree"]).flatmap(cases))
def test_greedy_follows_the_target_argmax(case):
    """Greedy: the path follows the first child carrying the target's argmax, and the next token is
    the argmax where the path stops, no child there carrying it."""
    parents, tokens, p, q, _, seed = case
    result = verify_tree(Tree(parents, tokens), p, q, "greedy", torch.Generator().manual_seed(seed))
    tree = Tree(parents, tokens)

    def argmax(row: int) -> int:  # smallest id on ties
        return int(torch.nonzero(p[row] == p[row].max())[0])

    node = -1
    expected = []
    while True:
        match = [c for c in tree.children[node] if tokens[c] == argmax(node + 1)]
        if not match:
            break
        expected.append(match[0])
        node = match[0]
    assert result.accepted == expected
    assert result.next_token == argmax(node + 1)


SAMPLED_CASES = st.sampled_from(["chain", "tree"]).flatmap(
    lambda structure: cases(structure, ("with_replacement", "without_replacement"))
)


@SETTINGS
@given(SAMPLED_CASES)
def test_alpha_one_accepts_the_first_child_everywhere(case):
    """p == q for sampled children: r(x) / q(x) = 1, so the first child is accepted at every node."""
    parents, tokens, p, _, proposal, seed = case
    tree = Tree(parents, tokens)
    for node in range(-1, len(parents)):  # make every child drawable from q = p
        for c in tree.children[node]:
            if p[node + 1, tokens[c]] <= 0 or proposal == "without_replacement":
                support = torch.nonzero(p[node + 1] > 0).flatten().tolist()
                kids = tree.children[node]
                if len(support) < len(kids):
                    return
                for k, t in zip(kids, support, strict=False):
                    tokens[k] = t
                break
    result = run(parents, tokens, p, p.clone(), proposal, seed)
    node, expected = -1, []
    while Tree(parents, tokens).children[node]:
        node = Tree(parents, tokens).children[node][0]
        expected.append(node)
    assert result.accepted == expected


@SETTINGS
@given(st.sampled_from(["chain", "tree"]).flatmap(cases))
def test_deterministic_ignores_the_draft_softmax(case):
    """For deterministic proposals q is a point mass whatever the draft said: passing draft_probs or
    not must not change anything (same seed, same result)."""
    parents, tokens, p, q, _, seed = case
    q = torch.softmax(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed % 1000)), -1)
    with_q = verify_tree(Tree(parents, tokens), p, q, "deterministic", torch.Generator().manual_seed(seed))
    without = verify_tree(Tree(parents, tokens), p, None, "deterministic", torch.Generator().manual_seed(seed))
    assert with_q == without
    check_invariants(parents, tokens, p, with_q)


@SETTINGS
@given(st.sampled_from(["chain", "tree"]).flatmap(cases))
def test_same_seed_same_result_and_global_rng_untouched(case):
    parents, tokens, p, q, proposal, seed = case
    state = torch.get_rng_state()
    a = run(parents, tokens, p, q, proposal, seed)
    b = run(parents, tokens, p, q, proposal, seed)
    assert a == b
    assert torch.equal(state, torch.get_rng_state()), "the verifier must draw from its own generator only"
