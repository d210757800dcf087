"""Drafting with the head's own cache: TreeConfig, tree shape and order, the global rerank, the draft
cache contract, catch-up chunking, sampled trees (Gumbel-top-k, no pruning, their q rows).

The reference below recomputes the draft logits of every node as a chain (committed pairs, then the
node's ancestors and itself) with ``Eagle3DraftModel.step`` and explicit keys and values, i.e.
without the drafter's tree mask, cache slots or batching; trees are then grown from those logits by
the rule of docs/ARCHITECTURE.md (top-k children per frontier node, the top-k nodes of a level by
cumulative log-probability expanded next, a global rerank keeping ``total_tokens`` nodes).
Logits are compared at atol 1e-5 (float32).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from scipy.stats import chi2

from eagle_tree import SamplingConfig, processed_probs
from eagle_tree.core.verify import Proposal
from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.decoding.drafting import Drafter, TreeConfig, sampled_nodes
from eagle_tree.models.cache import DraftCache
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel
from tests.helpers import PastKV

ATOL = 1e-5
VOCAB = 64
PROMPT = [7, 3, 19, 40, 2, 61, 8, 33, 12, 5, 27, 50]
FIRST = 9  # the token after the prompt (any token: drafting does not care how it was chosen)
GREEDY = SamplingConfig(temperature=0.0)
T1 = SamplingConfig(temperature=1.0)



@functools.cache
def _target() -> TargetModel:
    return TargetModel(tiny_causal_lm("llama", vocab_size=VOCAB, hidden_size=32, num_heads=2, num_kv_heads=1,
                                      intermediate_size=64, num_layers=4, initializer_range=0.1))


@functools.cache
def _head(reduced: bool = False) -> Eagle3DraftModel:
    vocab = list(range(0, VOCAB, 3)) + [FIRST, 40] if reduced else None  # 24 draft tokens
    head = Eagle3DraftModel.from_target(_target(), draft_vocab=vocab, seed=2)
    with torch.no_grad():  # sharper draft logits than the default init: distinct, well-separated scores
        head.lm_head.weight.mul_(4.0)
    return head.eval()


@functools.cache
def _pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Committed pairs of the prompt: target features (1, P, 3H) and the next tokens (1, P)."""
    out = _target().prefill(torch.tensor([PROMPT]), _target().new_cache())
    return out.features, torch.tensor([PROMPT[1:] + [FIRST]])


def _drafter(cfg: TreeConfig, reduced: bool = False, chunks: tuple[int, ...] = ()) -> Drafter:
    """A drafter that has consumed the prompt's pairs, in one catch_up or in ``chunks``."""
    d = Drafter(_head(reduced), cfg)
    features, tokens = _pairs()
    start = 0
    for n in chunks + (features.shape[1] - sum(chunks),):
        d.catch_up(features[:, start : start + n], tokens[:, start : start + n])
        start += n
    return d


# ----------------------------------------------------------------------------------- the reference


class ChainReference:
    """Draft logits (over the draft vocabulary) after the committed pairs and a path of target ids
    below the root, each path recomputed on its own as a chain with ``step``."""

    def __init__(self, head: Eagle3DraftModel):
        self.head = head
        features, tokens = _pairs()
        m = features.shape[1]
        with torch.no_grad():
            mask = torch.ones(m, m, dtype=torch.bool).tril()[None, None]
            self.kv = PastKV()
            out, logits = head.step(head.fuse(features), tokens, torch.arange(m)[None], self.kv, mask)
        self.m, self.root_hidden, self.root_logits = m, out[:, -1:], logits[0, -1]

    @functools.cache  # noqa: B019 (one instance per test)
    def logits(self, path: tuple[int, ...]) -> torch.Tensor:
        if not path:
            return self.root_logits
        hidden, past = self.root_hidden, self.kv.copy()
        with torch.no_grad():
            for depth, token in enumerate(path, start=1):
                mask = torch.ones(1, 1, 1, past.length + 1, dtype=torch.bool)
                pos = torch.tensor([[self.m - 1 + depth]])
                hidden, logits = self.head.step(hidden, torch.tensor([[token]]), pos, past, mask)
        return logits[0, -1]


def _grow(ref: ChainReference, cfg: TreeConfig) -> tuple[list[tuple[int, ...]], list[tuple[tuple[int, ...], float]]]:
    """The deterministic tree by the documented rule: (kept paths in creation order, every candidate
    as (path, cumulative draft log-prob))."""
    d2t = ref.head.draft_to_target
    nodes: list[tuple[tuple[int, ...], float]] = []

    def expand(path, score):
        logp = torch.log_softmax(ref.logits(path).float(), -1)
        top = torch.topk(logp, min(cfg.top_k, logp.numel()))
        made = []
        for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            nodes.append((path + (int(d2t[index]),), score + value))
            made.append(len(nodes) - 1)
        return made

    level = expand((), 0.0)
    for _ in range(1, cfg.depth):
        frontier = sorted(sorted(level, key=lambda i: -nodes[i][1])[: cfg.top_k])
        level = [c for i in frontier for c in expand(*nodes[i])]
    keep = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i][1], i))[: cfg.total_tokens])
    return [nodes[i][0] for i in keep], nodes


def _paths(proposal: Proposal) -> list[tuple[int, ...]]:
    tree = proposal.tree
    return [tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(len(tree))]


# ------------------------------------------------------------------------------------- TreeConfig


def test_tree_config_defaults_chain_and_rules():
    cfg = TreeConfig()
    assert (cfg.depth, cfg.top_k, cfg.total_tokens, cfg.sampled) == (6, 8, 48, False) and not cfg.is_chain
    chain = TreeConfig.chain(length=5)
    assert (chain.depth, chain.top_k, chain.total_tokens, chain.sampled) == (5, 1, 5, False) and chain.is_chain
    assert TreeConfig.chain(3, sampled=True).sampled
    sampled = TreeConfig(depth=2, top_k=2, total_tokens=6, sampled=True)
    assert cfg.rule(GREEDY) == "greedy" == sampled.rule(GREEDY)
    assert cfg.rule(T1) == "deterministic"
    assert sampled.rule(SamplingConfig(temperature=0.7, top_k=5)) == "without_replacement"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.depth = 3


@pytest.mark.parametrize(
    "kwargs",
    [dict(depth=0), dict(top_k=0), dict(total_tokens=0), dict(depth=-2), dict(depth=2.0), dict(top_k=True),
     dict(total_tokens="48"), dict(top_k=9, total_tokens=8, sampled=True)],
)
def test_tree_config_rejects_invalid_values(kwargs):
    with pytest.raises(ValueError, match="TreeConfig|top_k"):
        TreeConfig(**kwargs)


def test_chain_rejects_a_zero_length():
    with pytest.raises(ValueError, match="TreeConfig.depth"):
        TreeConfig.chain(length=0)


# ----------------------------------------------------------------------------- deterministic trees


CONFIGS = {
    "chain": TreeConfig.chain(length=4),
    "small-tree": TreeConfig(depth=3, top_k=3, total_tokens=8),
    "wide-tree": TreeConfig(depth=4, top_k=4, total_tokens=12),
    "no-rerank-cut": TreeConfig(depth=2, top_k=2, total_tokens=20),
}


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
@pytest.mark.parametrize("name", CONFIGS)
def test_deterministic_tree_is_the_documented_rerank(name, reduced):
    cfg = CONFIGS[name]
    d = _drafter(cfg, reduced)
    proposal = d.propose(T1)[0]
    assert proposal.rule == "deterministic" and proposal.draft_probs is None
    ref = ChainReference(_head(reduced))
    kept, candidates = _grow(ref, cfg)
    assert _paths(proposal) == kept  # same nodes, parents first, siblings in proposal order

    tree = proposal.tree
    assert all(p < i for i, p in enumerate(tree.parents))
    assert tree.max_depth <= cfg.depth and len(tree) <= cfg.total_tokens
    assert len(tree) == min(cfg.total_tokens, len(candidates))
    # the rerank keeps the best cumulative log-probabilities
    score = dict(candidates)
    kept_scores = [score[p] for p in kept]
    dropped = [s for p, s in candidates if p not in set(kept)]
    assert not dropped or min(kept_scores) >= max(dropped)
    # siblings in proposal order: non-increasing draft log-probability under their parent
    for node, kids in tree.children.items():
        parent_path = () if node == -1 else _paths(proposal)[node]
        logp = torch.log_softmax(ref.logits(parent_path), -1)
        values = [float(logp[_t2d(ref.head, tree.tokens[k])]) for k in kids]
        assert values == sorted(values, reverse=True)
    if reduced:  # only draft-vocabulary tokens, in target ids
        assert set(tree.tokens) <= set(ref.head.draft_to_target.tolist())


def _t2d(head: Eagle3DraftModel, target_id: int) -> int:
    return int((head.draft_to_target == target_id).nonzero()[0, 0])


def test_chain_follows_the_draft_argmax():
    d = _drafter(TreeConfig.chain(length=5))
    proposal = d.propose(T1)[0]
    ref = ChainReference(_head())
    tree = proposal.tree
    assert tree.parents == [-1, 0, 1, 2, 3]
    for i in range(5):
        assert tree.tokens[i] == int(torch.argmax(ref.logits(tuple(tree.tokens[:i]))))


def test_node_logits_equal_chain_recomputation():
    """The drafter's tree-masked, batched forwards give every node the logits of its own path."""
    d = _drafter(TreeConfig(depth=4, top_k=3, total_tokens=20))
    seen: list[torch.Tensor] = []
    forward = d._forward

    def recording(*args):
        out, logits = forward(*args)
        seen.append(logits[0])
        return out, logits

    d._forward = recording
    proposal = d.propose(GREEDY)[0]
    ref = ChainReference(_head())
    assert torch.allclose(d.logits[0], ref.logits(()), atol=ATOL, rtol=0)
    # each forward feeds a level's frontier; compare every fed node's logits with its chain recomputation
    paths = {p: i for i, p in enumerate(_paths(proposal))}
    checked = 0
    for logits in seen:
        for row in logits:
            match = [p for p in paths if torch.allclose(row, ref.logits(p), atol=ATOL, rtol=0)]
            assert match, "a fed node's draft logits match no path of the tree"
            checked += 1
    assert checked >= 3 * 3  # levels 1..3 fed, 3 nodes each


def test_propose_crops_the_draft_cache_and_keeps_committed_entries():
    d = _drafter(TreeConfig(depth=4, top_k=3, total_tokens=10))
    k0, v0 = (t.clone() for t in d.cache.view())
    length = d.cache.length
    assert length == len(PROMPT)
    first = d.propose(T1)[0]
    assert d.cache.length == length
    k1, v1 = d.cache.view()
    assert torch.equal(k0, k1) and torch.equal(v0, v1)
    second = d.propose(T1)[0]  # a second proposal from the same state is the same tree
    assert second.tree.parents == first.tree.parents and second.tree.tokens == first.tree.tokens


@pytest.mark.parametrize("chunks", [(5, 1, 3), (1,) * 11, (11,)])
def test_one_catch_up_equals_several_smaller_ones(chunks):
    cfg = TreeConfig(depth=3, top_k=3, total_tokens=9)
    whole, pieces = _drafter(cfg), _drafter(cfg, chunks=chunks)
    assert whole.cache.length == pieces.cache.length == len(PROMPT)
    assert torch.allclose(whole.logits[0], pieces.logits[0], atol=ATOL, rtol=0)
    assert torch.allclose(whole.last_hidden, pieces.last_hidden, atol=ATOL, rtol=0)
    for a, b in zip(whole.cache.view(), pieces.cache.view(), strict=True):
        assert torch.allclose(a, b, atol=ATOL, rtol=0)
    p, q = whole.propose(T1)[0], pieces.propose(T1)[0]
    assert (p.tree.parents, p.tree.tokens) == (q.tree.parents, q.tree.tokens)
    whole.config = pieces.config = TreeConfig(depth=2, top_k=3, total_tokens=12, sampled=True)
    s1, s2 = (x.propose(T1, [torch.Generator().manual_seed(4)])[0] for x in (whole, pieces))
    assert s1.tree.tokens == s2.tree.tokens
    assert torch.allclose(s1.draft_probs, s2.draft_probs, atol=ATOL, rtol=0)


def test_propose_needs_a_catch_up_first():
    with pytest.raises(RuntimeError, match="catch_up"):
        Drafter(_head(), TreeConfig()).propose(T1)[0]


def test_draft_cache_append_crop_and_growth():
    cache = DraftCache()
    chunks = [torch.randn(1, 2, n, 4) for n in (3, 300, 5)]  # the second one outgrows the first buffer
    for c in chunks:
        cache.append(c, -c)
    k, v = cache.view()
    assert cache.length == 308 and torch.equal(k, torch.cat(chunks, 2)) and torch.equal(v, -k)
    cache.crop(3)
    cache.append(chunks[2], chunks[2])
    k, v = cache.view()
    assert cache.length == 8 and torch.equal(k, torch.cat([chunks[0], chunks[2]], 2))
    cache.crop(100)  # cropping never grows
    assert cache.length == 8


# ----------------------------------------------------------------------------------- sampled trees


SAMPLED = [
    (TreeConfig(depth=2, top_k=3, total_tokens=12, sampled=True), T1),
    (TreeConfig(depth=4, top_k=2, total_tokens=14, sampled=True), SamplingConfig(temperature=0.7, top_k=4)),
    (TreeConfig(depth=3, top_k=3, total_tokens=21, sampled=True), SamplingConfig(temperature=1.0, top_p=0.5)),
    (TreeConfig.chain(length=3, sampled=True), SamplingConfig(temperature=0.7, top_p=0.9)),
]


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
@pytest.mark.parametrize("cfg, sampling", SAMPLED)
def test_sampled_trees_never_prune_and_carry_their_q(cfg, sampling, reduced):
    d = _drafter(cfg, reduced)
    ref = ChainReference(_head(reduced))
    d2t = ref.head.draft_to_target
    global_state = torch.get_rng_state()
    for seed in range(3):
        proposal = d.propose(sampling, [torch.Generator().manual_seed(seed)])[0]
        tree, q_all = proposal.tree, proposal.draft_probs
        assert proposal.rule == "without_replacement"
        assert q_all.shape == (len(tree) + 1, VOCAB) and q_all.dtype == torch.float32
        assert all(p < i for i, p in enumerate(tree.parents))
        assert tree.max_depth <= cfg.depth and len(tree) <= cfg.total_tokens
        paths = _paths(proposal)
        expanded_per_level: dict[int, int] = {}
        for node, kids in tree.children.items():
            q = q_all[node + 1]
            if not kids:
                assert float(q.sum()) == 0.0  # no children, no law
                continue
            depth = 0 if node == -1 else tree.depth[node]
            expanded_per_level[depth] = expanded_per_level.get(depth, 0) + 1
            # the row is the processed draft distribution at that node, in target ids
            expected = torch.zeros(VOCAB)
            expected[d2t] = processed_probs(ref.logits(() if node == -1 else paths[node]), sampling)
            assert torch.allclose(q, expected, atol=ATOL, rtol=0)
            assert abs(float(q.sum()) - 1.0) < 1e-5
            # no pruning: exactly top_k children, or all of q's support when it is smaller
            assert len(kids) == min(cfg.top_k, int((q > 0).sum()))
            tokens = [tree.tokens[k] for k in kids]
            assert len(set(tokens)) == len(tokens) and all(q[t] > 0 for t in tokens)  # without replacement
        # every level below the root is drawn and expands its top_k nodes (or all of them): the tree is its name
        levels = [expanded_per_level.get(depth, 0) for depth in range(cfg.depth)]
        assert levels[0] == 1 and tree.max_depth == cfg.depth
        for depth in range(1, cfg.depth):
            width = sum(1 for i in range(len(tree)) if tree.depth[i] == depth)
            assert levels[depth] == min(cfg.top_k, width)
        if sampling.top_k is None and sampling.top_p is None and not reduced:  # q's support is never short
            assert len(tree) == cfg.total_tokens == sampled_nodes(cfg.depth, cfg.top_k)
    assert torch.equal(global_state, torch.get_rng_state())  # the drafter draws from its own generator


@pytest.mark.parametrize("depth, top_k, nodes", [(1, 4, 4), (2, 4, 20), (2, 2, 6), (3, 2, 10), (2, 3, 12), (4, 2, 14),
                                                  (3, 3, 21), (5, 1, 5)])
def test_sampled_nodes_counts_every_level(depth, top_k, nodes):
    assert sampled_nodes(depth, top_k) == nodes
    assert TreeConfig(depth=depth, top_k=top_k, total_tokens=nodes, sampled=True).total_tokens == nodes


@pytest.mark.parametrize("depth, top_k, total, fix", [
    (2, 4, 8, "total_tokens=20, or depth=1 with total_tokens=4"),  # the shape that used to draft one level of 4
    (3, 3, 12, "total_tokens=21, or depth=2 with total_tokens=12"),
    (6, 8, 48, "total_tokens=328, or depth=1 with total_tokens=8"),
    (2, 2, 10, "must be 6, not 10: set total_tokens=6"),  # more room than it draws: the name would overstate it
])
def test_a_sampled_shape_whose_levels_do_not_make_total_tokens_is_refused(depth, top_k, total, fix):
    """A sampled tree keeps every child it draws: its name must be the tree it draws at T > 0."""
    with pytest.raises(ValueError, match="keeps every child it draws") as err:
        TreeConfig(depth=depth, top_k=top_k, total_tokens=total, sampled=True)
    assert fix in str(err.value)
    with pytest.raises(ValueError, match="keeps every child it draws"):
        TreeConfig.from_name(f"tree-d{depth}k{top_k}n{total}-sampled")
    TreeConfig(depth=depth, top_k=top_k, total_tokens=total)  # the deterministic tree reranks to total_tokens


def test_a_sampled_tree_draws_every_level_it_names():
    """d2 k4 n20 at T = 1: 4 root children, then 4 children under each of them (20 nodes, depth 2);
    d1 k4 n4 draws the 4 siblings alone. Negative control: the two are told apart."""
    deep = _drafter(TreeConfig(depth=2, top_k=4, total_tokens=20, sampled=True))
    flat = _drafter(TreeConfig(depth=1, top_k=4, total_tokens=4, sampled=True))
    a = deep.propose(T1, [torch.Generator().manual_seed(1)])[0].tree
    b = flat.propose(T1, [torch.Generator().manual_seed(1)])[0].tree
    assert (len(a), a.max_depth) == (20, 2) and sorted(a.children[-1]) == [0, 1, 2, 3]
    assert all(len(a.children[c]) == 4 for c in a.children[-1])
    assert (len(b), b.max_depth) == (4, 1)


def test_sampled_trees_are_random_and_reproducible():
    d = _drafter(TreeConfig(depth=2, top_k=3, total_tokens=12, sampled=True))
    trees = [tuple(d.propose(T1, [torch.Generator().manual_seed(s)])[0].tree.tokens) for s in (0, 0, 1, 2, 3)]
    assert trees[0] == trees[1] and len(set(trees)) >= 3


def test_sampled_config_at_temperature_zero_drafts_the_deterministic_tree():
    cfg = TreeConfig(depth=3, top_k=2, total_tokens=10)
    greedy = _drafter(dataclasses.replace(cfg, sampled=True)).propose(GREEDY, [torch.Generator().manual_seed(0)])[0]
    assert greedy.rule == "greedy" and greedy.draft_probs is None
    assert _paths(greedy) == _grow(ChainReference(_head()), cfg)[0]


def test_gumbel_top_k_children_follow_sampling_without_replacement():
    """Root children of a sampled tree: the first is a draw from q, the second a draw from q without
    the first (in that order). Chi-square of the joint law of (c1, c2) over 3000 proposals; the same
    counts read in the wrong order, (c2, c1), are rejected (the check is not vacuous)."""
    head = _head(reduced=True)
    d = _drafter(TreeConfig(depth=1, top_k=2, total_tokens=2, sampled=True), reduced=True)
    sampling = SamplingConfig(temperature=1.0, top_k=8)  # 8 tokens of support: 56 ordered pairs
    q = processed_probs(d.logits[0], sampling).double()
    law = q[:, None] * q[None, :] / (1 - q[:, None])  # P(c1 = a, c2 = b) = q(a) q(b) / (1 - q(a))
    law.fill_diagonal_(0)
    n = 3000
    counts = torch.zeros_like(law)
    g = torch.Generator().manual_seed(0)
    t2d = {int(t): i for i, t in enumerate(head.draft_to_target)}
    for _ in range(n):
        a, b = d.propose(sampling, [g])[0].tree.tokens
        counts[t2d[a], t2d[b]] += 1
    assert _pvalue(counts, law) > 1e-5
    assert _pvalue(counts.T, law) < 1e-5


def _pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    """Pearson chi-square; cells with expected count < 5 pooled into one; an observation in a
    zero-probability cell gives 0."""
    counts, law = counts.flatten().double(), law.flatten().double()
    if counts[law <= 0].sum() > 0:
        return 0.0
    expected = law * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(chi2.sf(stat, len(obs) - 1))


@pytest.mark.parametrize("cfg, sampling", [(TreeConfig(depth=4, top_k=3, total_tokens=10), T1),
                                           (TreeConfig(depth=2, top_k=3, total_tokens=12, sampled=True), T1)],
                         ids=["deterministic", "sampled"])
def test_propose_makes_one_host_transfer(cfg, sampling, monkeypatch):
    """Tree growth stays in tensors: the only conversion to Python values in ``propose`` is the final
    tree's (one ``tolist``); sampled trees draw each level with one call to the drafter's generator."""
    d = _drafter(cfg)
    calls: list[str] = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _f=original, **k: calls.append(_n)
                            or _f(self, *a, **k))
    rand = torch.rand
    draws: list[tuple[int, ...]] = []
    monkeypatch.setattr(torch, "rand", lambda *a, **k: draws.append(tuple(a[0])) or rand(*a, **k))
    proposal = d.propose(sampling, [torch.Generator().manual_seed(0)])[0]
    monkeypatch.undo()
    assert calls == ["tolist"]
    if cfg.sampled:  # the root, then one draw per fed level, each over the whole frontier
        assert [shape[0] for shape in draws] == [1, cfg.top_k, cfg.top_k][: len(draws)] and len(draws) >= 2
    else:
        assert not draws and len(proposal.tree) == cfg.total_tokens
