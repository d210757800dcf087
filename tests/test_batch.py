"""Batched decoding (decoding/batch.py): exact per request, with negative controls.

- The pieces: ``TargetCache`` of B requests (per-request writes, per-request compaction, requests
  leaving and joining) against one-request caches; ``rows_visibility``; a Drafter of B requests
  against B one-request drafters.
- Greedy: every row of ``generate_batch`` equals plain greedy decoding of its prompt alone, for plain
  decoding, chains, trees, sampled trees and context branches, on full-attention and sliding-window
  targets, prompts of different lengths, rows leaving at different times (budgets, EOS).
- Sampling: row i equals ``generate(prompt_i, seed=seed * n + i)`` token for token (its own
  generators: rows never share draws), and the law of each row's first tokens passes the model-level
  chi-square check with batch sizes above 1 and prompts of different lengths.
- Negative controls: a compaction that writes a row's entries into its neighbour's cache, and a mask
  that lets rows see the stale slots (padding) between their length and the longest row's, both fail
  the greedy check; two rows sharing one generator fail the independence check.
- ``serve``: arrival times, FIFO admission into free rows, per-request timing, the same outputs.
"""

from __future__ import annotations

import functools

import pytest
import torch

import eagle_tree.models.target as target_module
from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.core.tree import Tree
from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.decoding.context import ContextConfig
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import Drafter, TreeConfig
from eagle_tree.decoding.rounds import Request
from eagle_tree.models.cache import TargetCache
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel, rows_visibility
from tests.test_decoder_exactness import ALPHA, SPROMPT, SV, _chi2_pvalue, _exact_laws, _sampling_head, _sampling_target

VOCAB = 128
GREEDY, T1 = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)
LENGTHS = (5, 11, 3, 8)
SHAPES = {
    "plain": None,
    "chain": TreeConfig.chain(length=4),
    "tree": TreeConfig(depth=4, top_k=3, total_tokens=12),
    "sampled-tree": TreeConfig(depth=2, top_k=3, total_tokens=12, sampled=True),
    "tree-context": TreeConfig(depth=3, top_k=2, total_tokens=6, context=ContextConfig(lookup_tokens=4)),
    "context-only": TreeConfig(context=ContextConfig(lookup_tokens=4)),  # no head: prompt lookup
}


@functools.cache
def _target(family: str = "llama") -> TargetModel:
    extra = {"sliding_window": 8} if family == "mistral" else {}
    return TargetModel(tiny_causal_lm(family, vocab_size=VOCAB, initializer_range=0.2, seed=0, **extra))


@functools.cache
def _head(family: str = "llama") -> Eagle3DraftModel:
    return Eagle3DraftModel.from_target(_target(family), seed=0)


def _prompts(lengths=LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _decoder(shape: str, family: str = "llama") -> SpeculativeDecoder:
    tree = SHAPES[shape]
    head = None if tree is None or shape == "context-only" else _head(family)
    return SpeculativeDecoder(_target(family), head, tree=tree or TreeConfig())


@functools.cache
def _plain_greedy(family: str, prompt: tuple[int, ...], n: int) -> list[int]:
    return SpeculativeDecoder(_target(family)).generate(torch.tensor([prompt]), max_new_tokens=n).sequences[0].tolist()


# ------------------------------------------------------------------------------------------ pieces


def _kv(n_rows: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_rows, 2, t, 4, generator=g), torch.randn(n_rows, 2, t, 4, generator=g)


def test_batch_cache_rows_write_compact_leave_and_join():
    """Request b of a TargetCache holds what a one-request cache fed the same entries holds, through ragged
    writes, per-request compaction, growth, requests leaving and requests joining."""
    cache = TargetCache(num_layers=1, requests=3, capacity=4)
    solo = [[] for _ in range(3)]  # the entries each row should hold, as (k, v) columns
    lengths = [2, 5, 3]
    k, v = _kv(3, 5, 0)
    for b, n in enumerate(lengths):  # a right-padded first write, then each row's own length
        solo[b] = [(k[b, :, i], v[b, :, i]) for i in range(n)]
    cache.layers[0].update(k, v)
    cache.set_lengths(lengths)
    for step in range(12):  # forwards of 4 entries per row, then keep a few of them per row
        k, v = _kv(3, 4, step + 1)
        starts = list(cache.lengths)
        cache.layers[0].update(k, v)
        cache.advance(4)
        keeps = [[0], [0, 1, 3], [0, 2]][step % 3:] + [[0], [0, 1, 3], [0, 2]][: step % 3]
        cache.compact(starts, keeps)
        for b in range(3):
            solo[b] += [(k[b, :, j], v[b, :, j]) for j in keeps[b]]
    assert cache.capacity > 4  # it grew

    def check():
        layer = cache.layers[0]
        for b, entries in enumerate(solo):
            assert cache.lengths[b] == len(entries)
            assert torch.equal(layer.keys[b, :, : len(entries)], torch.stack([e[0] for e in entries], 1))
            assert torch.equal(layer.values[b, :, : len(entries)], torch.stack([e[1] for e in entries], 1))

    check()
    cache.select([2, 0])
    solo = [solo[2], solo[0]]
    check()
    other = TargetCache(num_layers=1, requests=1, capacity=2)
    k, v = _kv(1, 3, 99)
    other.layers[0].update(k, v)
    other.advance(3)
    cache.extend(other)
    solo.append([(k[0, :, i], v[0, :, i]) for i in range(3)])
    check()
    with pytest.raises(ValueError, match="strictly ascending"):
        cache.compact(list(cache.lengths), [[1, 0], [0], [0]])


def test_rows_visibility_hides_other_rows_stale_slots_and_padding():
    trees = [Tree([-1, 0], [5, 6]), Tree([], [])]
    visible, positions = rows_visibility([3, 1], trees, past=3)
    assert visible.shape == (2, 3, 6) and positions.tolist() == [[3, 4, 5], [1, 1, 1]]
    assert visible[0].tolist() == [[True] * 4 + [False] * 2, [True] * 5 + [False], [True] * 6]
    # row 1: its one committed slot, its root at slot 1; slots 2 and 3 of its buffer are stale
    assert visible[1, 0].tolist() == [True, True, False, False, False, False]
    assert visible[1, 1].tolist() == [True, False, True, False, False, False]  # padding: itself only
    windowed, _ = rows_visibility([3, 1], trees, past=3, sliding_window=2)
    assert windowed[0, 0].tolist() == [False, False, True, True, False, False]


@pytest.mark.parametrize("shape", ["tree", "sampled-tree", "chain"])
def test_drafter_of_rows_equals_one_row_drafters(shape):
    """B rows of different lengths drafted together give each row the tree (and draft law) a one-row
    drafter gives it, with a row skipping a catch-up (count 0) kept as it was."""
    tree, head, target = SHAPES[shape], _head(), _target()
    prompts = [p.tolist() for p in _prompts((6, 9, 4))]
    out = [target.forward(torch.tensor([p]), target.new_cache()) for p in prompts]
    batch = Drafter(head, tree)
    batch.reset(3)
    feats = torch.zeros(3, 9, out[0].features.shape[2])
    ids = torch.zeros(3, 9, dtype=torch.long)
    for b, (p, o) in enumerate(zip(prompts, out, strict=True)):
        feats[b, : len(p)], ids[b, : len(p)] = o.features[0], torch.tensor(p[1:] + [7])
    batch.catch_up(feats, ids, [len(p) for p in prompts])
    solo = []
    for p, o in zip(prompts, out, strict=True):
        d = Drafter(head, tree)
        d.catch_up(o.features, torch.tensor([p[1:] + [7]]))
        solo.append(d)
    # a second catch-up in which row 1 has no new pairs
    extra = torch.randn(3, 2, feats.shape[2])
    batch.catch_up(extra, torch.tensor([[3, 4], [0, 0], [5, 6]]), [2, 0, 1])
    solo[0].catch_up(extra[:1], torch.tensor([[3, 4]]))
    solo[2].catch_up(extra[2:, :1], torch.tensor([[5]]))
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    together = batch.propose(T1, gens)
    for b, d in enumerate(solo):
        alone = d.propose(T1, [torch.Generator().manual_seed(b)])[0]
        assert (together[b].tree.parents, together[b].tree.tokens) == (alone.tree.parents, alone.tree.tokens)
        if alone.draft_probs is not None:
            assert torch.allclose(together[b].draft_probs, alone.draft_probs, atol=1e-5)
    assert batch.cache.lengths == [d.cache.length for d in solo]


# ------------------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_rows_equal_plain_greedy_alone(family, shape):
    prompts = _prompts()
    out = _decoder(shape, family).generate_batch(prompts, max_new_tokens=20)
    for p, seq, lengths in zip(prompts, out.sequences, out.acceptance_lengths, strict=True):
        assert seq.tolist() == _plain_greedy(family, tuple(p.tolist()), 20)
        assert sum(lengths) == 19
    assert out.rounds <= 19 and out.throughput > 0


def test_rows_leave_at_their_budget_or_eos():
    prompts = _prompts()
    ref = [_plain_greedy("llama", tuple(p.tolist()), 20) for p in prompts]
    eos = ref[1][len(prompts[1]) + 6]  # row 1 meets it as its 7th new token
    dec = _decoder("tree")
    out = dec.generate_batch(prompts, max_new_tokens=20, eos_token_id=eos)
    for p, r, res in zip(prompts, ref, out.results, strict=True):
        new = r[len(p) :]
        stop = next((i for i, t in enumerate(new) if t == eos), None)
        expected = new if stop is None else new[: stop + 1]
        assert res.sequence.tolist() == p.tolist() + expected
        assert res.stopped_by == ("eos" if stop is not None else "length")
        assert res.arrival_s <= res.admitted_s <= res.first_token_s <= res.finish_s
        assert len(res.token_times) == res.new_tokens and res.token_times == sorted(res.token_times)
    assert out.results[1].new_tokens == 7
    budgets = dec.serve([Request(p, n) for p, n in zip(prompts, (3, 20, 1, 9), strict=True)], max_batch=4)
    assert [r.new_tokens for r in budgets.results] == [3, 20, 1, 9]


def _leaky_compaction(monkeypatch):
    """Negative control: every round, the entry a row keeps for its root comes from the next row."""
    original = TargetCache.compact

    def leaky(self, starts, keeps):
        original(self, starts, keeps)
        if self.requests > 1 and self.layers[0].is_initialized:
            src = torch.tensor(starts).roll(-1)  # row b gets row b + 1's root entry
            rows, dst = torch.arange(self.requests), torch.tensor(starts)
            for layer in self.layers:
                layer.keys[rows, :, dst] = layer.keys[rows.roll(-1), :, src].clone()
                layer.values[rows, :, dst] = layer.values[rows.roll(-1), :, src].clone()

    monkeypatch.setattr(TargetCache, "compact", leaky)


def _mask_sees_padding(monkeypatch):
    """Negative control: queries also see the stale slots (padding) between their row's length and the
    longest row's."""
    original = target_module.rows_visibility

    def leaky(starts, trees, past, sliding_window=None):
        visible, positions = original(starts, trees, past, sliding_window)
        visible[:, :, :past] = True
        return visible, positions

    monkeypatch.setattr(target_module, "rows_visibility", leaky)


@pytest.mark.parametrize("control", [_leaky_compaction, _mask_sees_padding])
def test_negative_controls_fail_the_greedy_check(control, monkeypatch):
    prompts = _prompts()
    control(monkeypatch)
    out = _decoder("tree").generate_batch(prompts, max_new_tokens=20)
    wrong = [seq.tolist() != _plain_greedy("llama", tuple(p.tolist()), 20)
             for p, seq in zip(prompts, out.sequences, strict=True)]
    assert any(wrong)


# ---------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("shape", ["plain", "chain", "sampled-tree", "tree-context"])
def test_sampled_rows_equal_generate_with_their_own_seed(shape):
    prompts, seed = _prompts(), 3
    dec = _decoder(shape)
    out = dec.generate_batch(prompts, max_new_tokens=16, sampling=T1, seed=seed)
    for i, p in enumerate(prompts):
        alone = dec.generate(p, max_new_tokens=16, sampling=T1, seed=seed * len(prompts) + i)
        assert out.sequences[i].tolist() == alone.sequences[0].tolist()
        assert out.acceptance_lengths[i] == alone.acceptance_lengths


def test_rows_with_the_same_prompt_draw_independently():
    """Two rows with one prompt: their outputs differ in most calls (shared draws would make them equal),
    and the same call repeated gives the same outputs (each row's draws are its own and seeded)."""
    dec = _decoder("sampled-tree")
    prompt = _prompts((6,))[0]
    equal = 0
    for seed in range(10):
        out = dec.generate_batch([prompt, prompt], max_new_tokens=6, sampling=T1, seed=seed)
        equal += out.sequences[0].tolist() == out.sequences[1].tolist()
    assert equal <= 2
    again = [dec.generate_batch([prompt, prompt], max_new_tokens=6, sampling=T1, seed=4).sequences for _ in range(2)]
    assert [s.tolist() for s in again[0]] == [s.tolist() for s in again[1]]


def test_shared_generator_negative_control(monkeypatch):
    """Negative control: rows drawing from one shared generator fail the own-seed check above."""
    import eagle_tree.decoding.rounds as rounds_module

    original = rounds_module.RoundLoop.admit

    def admit(self, admitted):
        original(self, admitted)
        shared = self.running[0].verifier
        for row in self.running:
            row.verifier = shared

    monkeypatch.setattr(rounds_module.RoundLoop, "admit", admit)
    prompts, dec = _prompts(), _decoder("chain")
    out = dec.generate_batch(prompts, max_new_tokens=16, sampling=T1, seed=3)
    alone = [dec.generate(p, max_new_tokens=16, sampling=T1, seed=3 * len(prompts) + i).sequences[0].tolist()
             for i, p in enumerate(prompts)]
    assert [s.tolist() for s in out.sequences] != alone


@pytest.mark.slow
def test_batched_rows_follow_the_target_law():
    """Model-level chi-square per row: batch of 4 (two prompts of different lengths, each twice), the
    real head's sampled tree; the law of (x1, x2) after each prompt and of (x2, x3) for the first."""
    long_prompt = (2, 9, 4, 1, 7, 3, 3, 8)
    prompts = [torch.tensor(SPROMPT), torch.tensor(long_prompt)] * 2
    dec = SpeculativeDecoder(_sampling_target(), _sampling_head(False),
                             tree=TreeConfig(depth=2, top_k=3, total_tokens=12, sampled=True))
    counts = {p: torch.zeros(SV, SV) for p in (tuple(SPROMPT), long_prompt)}
    c23 = torch.zeros(SV, SV)
    for seed in range(500):
        out = dec.generate_batch(prompts, max_new_tokens=3, sampling=T1, seed=seed)
        for p, res in zip(prompts, out.results, strict=True):
            new = res.sequence[res.prompt_length :].tolist()
            counts[tuple(p.tolist())][new[0], new[1]] += 1
            if tuple(p.tolist()) == tuple(SPROMPT):
                c23[new[1], new[2]] += 1
    for p, c in counts.items():
        assert c.sum() == 1000
        assert _chi2_pvalue(c, _exact_laws(T1, p)[0]) > ALPHA
    assert _chi2_pvalue(c23, _exact_laws(T1)[1]) > ALPHA
    # the check can fail: the first prompt's counts against the second prompt's law
    assert _chi2_pvalue(counts[tuple(SPROMPT)], _exact_laws(T1, long_prompt)[0]) < ALPHA


# ------------------------------------------------------------------------------------------- serve


def test_serve_admits_in_arrival_order_into_free_rows():
    prompts = _prompts((5, 7, 4, 6, 3))
    arrivals = [0.0, 0.0, 0.05, 0.05, 0.3]
    dec = _decoder("chain")
    seen_rows = []
    original = dec.target.verify

    def counting(roots, trees, cache):
        seen_rows.append(len(trees))
        return original(roots, trees, cache)

    dec.target.verify = counting
    try:
        out = dec.serve([Request(p, 12, a) for p, a in zip(prompts, arrivals, strict=True)], max_batch=2)
    finally:
        del dec.target.verify
    assert max(seen_rows) == 2
    for p, a, res in zip(prompts, arrivals, out.results, strict=True):
        assert res.sequence.tolist() == _plain_greedy("llama", tuple(p.tolist()), 12)
        assert a <= res.admitted_s <= res.first_token_s <= res.finish_s
        assert res.ttft_s == res.first_token_s - a and res.latency_s == res.finish_s - a
    assert out.results[4].admitted_s >= 0.3
    # FIFO: requests 2 and 3 (arrived together) start no earlier than rows freed by 0 and 1
    assert min(out.results[2].admitted_s, out.results[3].admitted_s) >= min(r.finish_s for r in out.results[:2])


def test_batched_decoding_input_errors():
    dec = _decoder("chain")
    with pytest.raises(ValueError, match="at least one prompt"):
        dec.generate_batch([], max_new_tokens=4)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        dec.generate_batch([torch.tensor([], dtype=torch.long)], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_batch"):
        dec.serve([Request(torch.tensor([1, 2]), 4)], max_batch=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.serve([Request(torch.tensor([1, 2]), 0)], max_batch=1)

    class OneRow:
        def reset(self): ...
        def catch_up(self, features, next_tokens): ...
        def propose(self, sampling, generator=None): ...

    with pytest.raises(ValueError, match="one sequence"):
        SpeculativeDecoder(_target(), drafter=OneRow()).generate_batch(_prompts(), max_new_tokens=4)
