"""Context branches (eagle_tree/decoding/context.py): the index, the trie merge, phantoms in the
verifier, and the decoder with context branches (greedy equality, context only, off = unchanged)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from eagle_tree import SamplingConfig
from eagle_tree.core.tree import Tree
from eagle_tree.core.verify import Proposal, VerifyRule, verify_tree
from eagle_tree.decoding.context import ContextConfig, ContextDrafter, ContextIndex, merge_context
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import Drafter, OneSequence, TreeConfig
from tests.exact_reference import check_mixed, dist
from tests.test_decoder_exactness import (
    ALPHA,
    N_SEEDS,
    PROMPT,
    SV,
    T1,
    PerturbedDrafter,
    _chi2_pvalue,
    _draw,
    _exact_laws,
    _head,
    _reference,
    _sampling_target,
    _target,
)

GREEDY = SamplingConfig(temperature=0.0)

# ------------------------------------------------------------------------------------------ index


def test_longest_match_wins_then_the_most_recent():
    index = ContextIndex(max_ngram=3, min_ngram=1)
    index.extend([1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3])
    # suffix (1, 2, 3) occurred at the start: what followed it was 9, 2, 3, 4
    assert index.continuations(4) == [[9, 2, 3, 4]]
    assert index.continuations(2, branches=3) == [[9, 2], [4, 5]]  # then (2, 3) -> 4, 5; (3,) adds nothing new
    short = ContextIndex(max_ngram=1, min_ngram=1)
    short.extend([1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3])
    assert short.continuations(2) == [[4, 5]]  # most recent occurrence of (3,)
    assert (index.match_length(), short.match_length()) == (3, 1)  # the suffix the branches above came from


def test_copy_runs_on_with_overlap_in_a_loop():
    index = ContextIndex(max_ngram=2, min_ngram=1)
    index.extend([7, 1, 2, 1, 2])
    assert index.continuations(5) == [[1, 2, 1, 2, 1]]


def test_no_match_no_branch_and_min_ngram():
    index = ContextIndex(max_ngram=3, min_ngram=2)
    index.extend([1, 2, 3, 4, 3])  # (4, 3) never occurred before; (3,) did but is shorter than min_ngram
    assert index.continuations(3) == [] and index.match_length() == 0
    assert ContextIndex().continuations(3) == [] and ContextIndex().match_length() == 0


def test_incremental_index_equals_a_rebuild():
    tokens = torch.randint(0, 6, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = ContextIndex(4, 1), ContextIndex(4, 1)
    a.extend(tokens)
    for i in range(0, 200, 7):
        b.extend(tokens[i : i + 7])
        whole = ContextIndex(4, 1)
        whole.extend(tokens[: i + 7])
        assert b.continuations(5, branches=3) == whole.continuations(5, branches=3)
    assert a.table == b.table


def test_context_config_checks_and_tree_config_reads_a_mapping():
    with pytest.raises(ValueError, match="min_ngram"):
        ContextConfig(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="lookup_tokens"):
        ContextConfig(lookup_tokens=0)
    tree = TreeConfig(depth=2, context={"lookup_tokens": 4})
    assert tree.context == ContextConfig(lookup_tokens=4)
    assert hash(tree) == hash(TreeConfig(depth=2, context=ContextConfig(lookup_tokens=4)))


# ------------------------------------------------------------------------------------------ merge


def _siblings_distinct(tree: Tree) -> bool:
    return all(len({tree.tokens[c] for c in kids}) == len(kids) for kids in tree.children.values())


def test_merge_follows_head_nodes_then_adds_new_ones_deterministic():
    head = Tree([-1, -1, 0, 0], [5, 6, 7, 8])  # root -> 5 (-> 7, 8), 6
    merged, probs = merge_context(head, None, VerifyRule.DETERMINISTIC, [[5, 8, 9, 10]])
    assert probs is None and merged.point_mass is None and merged.phantoms == []
    paths = {tuple(merged.tokens[i] for i in p) for p in merged.paths}
    assert paths == {(5, 8, 9, 10), (5, 7), (6,)}
    assert len(merged) == 6  # 5, 6, 7, 8 shared or kept; 9 and 10 added
    assert _siblings_distinct(merged)
    assert merged.children[-1][0] == 0 and merged.tokens[0] == 5  # context first at every node
    assert all(p < i for i, p in enumerate(merged.parents))


def test_merge_sampled_context_first_leaves_a_phantom():
    head = Tree([-1, -1, -1, 1], [4, 5, 6, 9])  # drawn in this order; node 1 (token 5) has a child 9
    q = torch.rand(5, 12)
    merged, probs = merge_context(head, q, VerifyRule.WITHOUT_REPLACEMENT, [[5, 3]])
    assert merged.tokens[:3] == [5, 4, 6]  # the context token first, then the remaining drawn children
    assert merged.point_mass[:3] == [True, False, False]
    assert merged.phantoms == [(-1, 2, 5)]  # the drawn 5 is still checked, after the drawn 4
    assert merged.checks(-1) == [(5, 0), (4, 1), (5, None), (6, 2)]
    assert sorted(merged.tokens[c] for c in merged.children[0]) == [3, 9]  # both subtrees below 5
    assert _siblings_distinct(merged)
    assert torch.equal(probs[0], q[0]) and torch.equal(probs[1], q[2])  # node 0 carries the head's row of 5
    nine = merged.tokens.index(9)
    assert torch.equal(probs[nine + 1], q[4]) and not probs[merged.tokens.index(3) + 1].any()


def test_merge_sampled_head_first_shares_the_drawn_node():
    head = Tree([-1, -1], [4, 5])
    merged, _ = merge_context(head, torch.rand(3, 8), VerifyRule.WITHOUT_REPLACEMENT, [[5, 1], [2]], first="head")
    assert merged.tokens[:3] == [4, 5, 2] and merged.point_mass[:3] == [False, False, True]
    assert merged.phantoms == []


def test_a_phantom_must_repeat_an_earlier_point_mass():
    with pytest.raises(ValueError, match="phantom"):
        Tree([-1, -1], [3, 4], point_mass=[False, False], phantoms=[(-1, 1, 3)])
    with pytest.raises(ValueError, match="phantom"):
        Tree([-1, -1], [3, 4], point_mass=[True, False], phantoms=[(-1, 0, 3)])  # before the point mass
    Tree([-1, -1], [3, 4], point_mass=[True, False], phantoms=[(-1, 1, 3)])


# ------------------------------------------------------------------------------------------ verifier


@pytest.mark.parametrize("rule", ["with_replacement", "without_replacement"])
def test_verifier_on_a_mixed_node_matches_the_exact_reference(rule):
    """Context token 0 (point mass), then drawn 1, the phantom 0, drawn 2: the tensor verifier's law of
    (accepted child or correction token) equals ``check_mixed``'s (chi-square, 20,000 draws)."""
    p, q = dist(4, 1, 3, 2), dist(2, 3, 4, 1)
    tree = Tree([-1, -1, -1], [0, 1, 2], point_mass=[True, False, False], phantoms=[(-1, 2, 0)])
    checks = [(0, False), (1, True), (0, True), (2, True)]
    law = [0.0] * 8  # outcomes 0..3: the accepted test; 4..7: the correction token
    for pr, i, corr in check_mixed(checks, p, q, rule):
        if i is None:
            for y, py in enumerate(corr):
                law[4 + y] += float(pr * py)
        else:
            law[i] += float(pr)
    assert law[2] == 0  # the phantom is never accepted
    target = torch.tensor([[float(x) for x in p]] + [[0.25] * 4] * 3)
    draft = torch.tensor([[float(x) for x in q]] + [[0.25] * 4] * 3)
    gen = torch.Generator().manual_seed(0)
    counts = [0] * 8
    test_of_node = {0: 0, 1: 1, 2: 3}
    n = 20_000
    for _ in range(n):
        res = verify_tree(tree, target, draft, rule, gen)
        counts[test_of_node[res.accepted[0]] if res.accepted else 4 + res.next_token] += 1

    def pvalue(counts):  # 0 when an impossible outcome was observed
        cells = [i for i in range(8) if law[i] > 0]
        if sum(counts[i] for i in cells) < n:
            return 0.0
        return chisquare([counts[i] for i in cells], [n * law[i] for i in cells]).pvalue

    assert pvalue(counts) > 1e-5
    # negative control: without the phantom the law is another one, and the same check sees it
    dropped = Tree([-1, -1, -1], [0, 1, 2], point_mass=[True, False, False])
    counts = [0] * 8
    for _ in range(n):
        res = verify_tree(dropped, target, draft, rule, gen)
        counts[test_of_node[res.accepted[0]] if res.accepted else 4 + res.next_token] += 1
    assert pvalue(counts) < 1e-5


# ------------------------------------------------------------------------------------------ decoder


@pytest.mark.parametrize("shape", ["context-only", "chain", "tree"])
def test_greedy_with_context_equals_plain_greedy(shape):
    ctx = ContextConfig(lookup_tokens=4, branches=2)
    ref = _reference("llama")
    prompt = torch.tensor([PROMPT])
    if shape == "context-only":
        dec = SpeculativeDecoder(_target("llama"), tree=TreeConfig(context=ctx))
    else:
        base = TreeConfig.chain(3) if shape == "chain" else TreeConfig(depth=3, top_k=3, total_tokens=8)
        dec = SpeculativeDecoder(_target("llama"), _head("llama"), tree=TreeConfig(**{
            **{k: getattr(base, k) for k in ("depth", "top_k", "total_tokens")}, "context": ctx}))
    assert isinstance(dec.drafter, ContextDrafter)
    out = dec.generate(prompt, max_new_tokens=len(ref) - len(PROMPT))
    assert out.sequences[0].tolist() == ref
    assert sum(r.tree_size for r in out.rounds) > 0  # context branches were proposed and verified
    assert dec.drafter.context_s > 0


def test_a_context_only_shape_ignores_the_head_it_is_given(tmp_path):
    """TreeConfig.context_only: the decoder holds a head but drafts with the context branches alone, the
    same tokens and rounds as a decoder without a head; and as a head folder's decoding.json default
    (what the bench's tuning writes when context alone wins) it is what SpeculativeDecoder(target, head)
    decodes with. Control: the same context with the head's drafts gives other rounds."""
    from eagle_tree.decoding.shapes import save_decoding_defaults
    from eagle_tree.models.head import Eagle3DraftModel

    ctx = ContextConfig(lookup_tokens=4)
    prompt, n = torch.tensor([PROMPT]), len(_reference("llama")) - len(PROMPT)
    alone = SpeculativeDecoder(_target("llama"), tree=TreeConfig(context=ctx)).generate(prompt, max_new_tokens=n)
    dec = SpeculativeDecoder(_target("llama"), _head("llama"), tree=TreeConfig.context_only(ctx))
    assert isinstance(dec.drafter, ContextDrafter) and dec.drafter.inner is None
    out = dec.generate(prompt, max_new_tokens=n)
    assert out.sequences[0].tolist() == _reference("llama") == alone.sequences[0].tolist()
    assert [r.tree_size for r in out.rounds] == [r.tree_size for r in alone.rounds]
    with_head = SpeculativeDecoder(_target("llama"), _head("llama"), tree=TreeConfig(depth=3, top_k=1, total_tokens=3,
                                                                                      context=ctx))
    drafted = with_head.generate(prompt, max_new_tokens=n)
    assert [r.tree_size for r in drafted.rounds] != [r.tree_size for r in out.rounds]
    _head("llama").save_pretrained(tmp_path / "head")
    save_decoding_defaults(tmp_path / "head", TreeConfig.context_only(ctx), greedy=True, by="test")
    default = SpeculativeDecoder(_target("llama"), Eagle3DraftModel.from_pretrained(tmp_path / "head",
                                                                                     target=_target("llama")))
    assert default.tree == TreeConfig.context_only(ctx) and default.drafter.inner is None
    assert default.generate(prompt, max_new_tokens=n).sequences[0].tolist() == _reference("llama")


def test_alone_ngram_leaves_the_head_out_of_matched_rounds_and_keeps_greedy_output():
    """ctx4-alone2: rounds whose suffix matched 2 tokens or more propose the branches alone (the head is
    not run), the others the head's chain with branches; greedy output stays plain greedy's. Control:
    without alone_ngram every round runs the head."""
    ctx = ContextConfig(lookup_tokens=4, alone_ngram=2)
    assert ctx.name == "ctx4-alone2" and ContextConfig.from_name("ctx4-alone2") == ctx
    assert ContextConfig.from_name("ctx8-g2to4-alone3-headfirst").alone_ngram == 3
    with pytest.raises(ValueError, match="alone_ngram"):
        ContextConfig(alone_ngram=0)
    ref = _reference("qwen3", 150)
    prompt = torch.tensor([PROMPT])
    rounds = {}
    for alone in (2, None):
        cfg = ContextConfig(lookup_tokens=4, alone_ngram=alone)
        dec = SpeculativeDecoder(_target("qwen3"), _head("qwen3"), tree=TreeConfig(depth=3, top_k=1, total_tokens=3,
                                                                                    context=cfg))
        out = dec.generate(prompt, max_new_tokens=150)
        assert out.sequences[0].tolist() == ref
        rounds[alone] = (dec.drafter.alone_rounds, len(out.rounds))
    alone_rounds, total = rounds[2]
    assert 0 < alone_rounds < total  # both kinds of round happened
    assert rounds[None][0] == 0


def test_context_only_commits_copied_tokens():
    """A prompt-lookup decoder in the same loop: over 150 greedy tokens of a tiny target, copied
    continuations are accepted (several tokens in a round) and the output is plain greedy's."""
    dec = SpeculativeDecoder(_target("qwen3"), tree=TreeConfig(context=ContextConfig(lookup_tokens=6)))
    out = dec.generate(torch.tensor([PROMPT]), max_new_tokens=150)
    assert out.sequences[0].tolist() == _reference("qwen3", 150)
    assert max(out.acceptance_lengths) >= 3


def test_context_off_builds_the_head_drafter_alone():
    dec = SpeculativeDecoder(_target("llama"), _head("llama"), tree=TreeConfig(context=None))
    assert type(dec.drafter) is Drafter
    assert SpeculativeDecoder(_target("llama")).drafter is None


def test_empty_context_proposals_leave_sampled_decoding_unchanged():
    """With no match the wrapper returns the head's proposal untouched: the same tokens, seed for seed,
    at temperature 1 with a sampled tree (same draft and verifier randomness)."""
    tree = TreeConfig(depth=2, top_k=2, total_tokens=6, sampled=True)
    t1 = SamplingConfig(temperature=1.0)
    plain = SpeculativeDecoder(_target("llama"), _head("llama"), tree=tree)
    never = ContextDrafter(Drafter(_head("llama"), tree), ContextConfig(max_ngram=8, min_ngram=8))
    wrapped = SpeculativeDecoder(_target("llama"), _head("llama"), tree=tree, drafter=never)
    for seed in range(3):
        a = plain.generate(torch.tensor([PROMPT]), 12, sampling=t1, seed=seed)
        b = wrapped.generate(torch.tensor([PROMPT]), 12, sampling=t1, seed=seed)
        assert a.sequences.tolist() == b.sequences.tolist()
        assert a.acceptance_lengths == b.acceptance_lengths


# ------------------------------------------------------------------------ sampling, model level
#
# The tiny 16-token target of test_decoder_exactness.py; the prompt holds every token once, so the
# first generated token x1 has always occurred and the context proposes what followed it. The head
# is a PerturbedDrafter drawing without replacement (Gumbel-top-k) from noisy target logits.

CPROMPT = (0, *range(SV))


class _Favourite:
    """An index stand-in proposing the head's most likely root token, then the next prompt token:
    a point mass the head draws again most of the time (so phantoms are frequent)."""

    def __init__(self, head: PerturbedDrafter):
        self.head = head

    def extend(self, tokens) -> None:
        pass

    def continuations(self, lookup_tokens: int, branches: int = 1) -> list[list[int]]:
        new = tuple(self.head.committed[len(self.head.prompt) :])
        top = int(self.head._logits(new).argmax())
        return [[top, (top + 1) % SV][:lookup_tokens]]


class _ParityFavourite(_Favourite):
    """The favourite's branch, reported as a 2-token match when the last committed token is even and as
    no match otherwise: a choice of alone rounds that reads only committed tokens, about half the time."""

    def match_length(self) -> int:
        return 2 if self.head.committed[-1] % 2 == 0 else 0


class _ContextDrafter(ContextDrafter):
    """The real wrapper, with a known-wrong variant of the merged tree for the negative controls:
    ``wrong="context_as_q"`` gives the verifier no point-mass flags (every child verified as drawn
    from q) and no phantoms; ``wrong="drop_phantoms"`` keeps the flags and drops the phantoms."""

    def __init__(self, inner, config, favourite: bool = False, wrong: str | None = None):
        self.favourite, self.wrong, self.phantoms, self.alone_total = favourite, wrong, 0, 0
        super().__init__(inner, config)

    def reset(self, requests: int = 1) -> None:
        super().reset(requests)
        if self.favourite == "parity":
            self.indexes = [_ParityFavourite(self.inner.inner)]
        elif self.favourite:
            self.indexes = [_Favourite(self.inner.inner)]

    def propose(self, sampling, generators) -> list[Proposal]:
        before = self.alone_rounds
        (prop,) = super().propose(sampling, generators)
        self.alone_total += self.alone_rounds - before  # over every run (reset() zeroes alone_rounds)
        t = prop.tree
        self.phantoms += len(t.phantoms)
        if self.wrong is not None:
            pm = None if self.wrong == "context_as_q" else t.point_mass
            t = Tree(t.parents, t.tokens, point_mass=pm)
        return [Proposal(t, prop.draft_probs, prop.rule)]


def _context_decoder(favourite: bool = False, wrong: str | None = None, width=(3, 2), lookup: int = 2,
                     first: str = "context", alone: int | None = None):
    head = PerturbedDrafter("without_replacement", width, prompt=CPROMPT)
    config = ContextConfig(lookup_tokens=lookup, first=first, alone_ngram=alone)
    drafter = _ContextDrafter(OneSequence(head), config, favourite=favourite, wrong=wrong)
    return SpeculativeDecoder(_sampling_target(), drafter=drafter)


@pytest.mark.slow
@pytest.mark.parametrize("favourite, first", [(False, "context"), (True, "context"), (True, "head")],
                         ids=["index", "favourite", "favourite-head-first"])
def test_sampled_output_with_context_follows_the_target_law(favourite, first):
    dec = _context_decoder(favourite, first=first)
    c12, c23, accepted = _draw(dec, T1, depth2=True, prompt=CPROMPT)
    joint12, joint23 = _exact_laws(T1, CPROMPT)
    assert _chi2_pvalue(c12, joint12) > ALPHA
    assert _chi2_pvalue(c23, joint23) > ALPHA
    assert sum(a >= 2 for a in accepted) > 0.03 * N_SEEDS
    if first == "context":
        assert dec.drafter.phantoms > (0.3 * N_SEEDS if favourite else 0)


@pytest.mark.slow
def test_sampled_output_with_alone_rounds_follows_the_target_law():
    """alone_ngram=2 with an index that reports a 2-token match after an even committed token: those
    rounds draft the favourite's branch alone, the others the head's sampled tree with it; the mixture
    keeps the target's law at depth 1 and 2."""
    dec = _context_decoder(favourite="parity", alone=2)
    c12, c23, accepted = _draw(dec, T1, depth2=True, prompt=CPROMPT)
    joint12, joint23 = _exact_laws(T1, CPROMPT)
    assert _chi2_pvalue(c12, joint12) > ALPHA
    assert _chi2_pvalue(c23, joint23) > ALPHA
    assert sum(a >= 1 for a in accepted) > 0.05 * N_SEEDS
    assert 0.2 * N_SEEDS < dec.drafter.alone_total  # rounds really left the head out


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["context_as_q", "drop_phantoms"])
def test_negative_controls_for_context_children_are_caught(wrong):
    """One context token at the root, beside three drawn children (which often repeat it)."""
    dec = _context_decoder(favourite=True, wrong=wrong, width=(3,), lookup=1)
    c12, _, _ = _draw(dec, T1, depth2=False, prompt=CPROMPT)
    assert _chi2_pvalue(c12, _exact_laws(T1, CPROMPT)[0]) < ALPHA
