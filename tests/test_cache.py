"""The TargetCache of one request: growth, compaction that moves only what it must, the mask buffer,
a cache that grows with the output, the round clock per request and per batch, and the row and
offset conventions of a round (Tree.row, Tree.cache_offsets)."""

from __future__ import annotations

import functools
import time

import pytest
import torch

import eagle_tree.decoding.rounds as rounds_module
from eagle_tree.core.tree import Tree
from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import Drafter, RoundDrafter, TreeConfig
from eagle_tree.decoding.rounds import RoundClock
from eagle_tree.models.cache import MIN_CAPACITY
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel

VOCAB = 64
PARENTS = [-1, -1, 0, 0, 1, 2]


@functools.cache
def _target(impl: str = "eager", family: str = "llama") -> TargetModel:
    return TargetModel(tiny_causal_lm(family, vocab_size=VOCAB, attn_implementation=impl), (1, 2, 3))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = cache.get_seq_length()
    return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in cache.layers]


def test_row_and_offset_conventions():
    assert Tree.row(-1) == 0 and Tree.row(4) == 5
    assert Tree.cache_offsets([]) == [0] and Tree.cache_offsets([0, 2, 5]) == [0, 1, 3, 6]
    tree = Tree(PARENTS, _tokens(len(PARENTS), 0))
    assert tree.position_offsets_with_root().tolist() == [0, 1, 1, 2, 2, 2, 3]
    mask = tree.attention_mask_with_root()
    assert mask[Tree.row(4)].tolist() == [True, False, True, False, False, True, False]  # root, node 1, itself
    assert torch.equal(tree.ancestor_mask(), mask[1:, 1:])
    tree.ancestor_mask()[0, 0] = False  # a copy: the tree's own matrix is unchanged
    assert bool(tree.ancestor_mask()[0, 0])


def test_buffers_grow_geometrically_and_keep_their_contents():
    target = _target()
    cache = target.new_cache(capacity=1)  # at least MIN_CAPACITY entries
    assert cache.capacity == MIN_CAPACITY
    prompt = _tokens(200, 1)
    target.prefill(torch.tensor([prompt[:50]]), cache)
    first = cache.capacity
    keys_before = cache.layers[0].keys[:, :, :50].clone()
    target.prefill(torch.tensor([prompt[50:]]), cache)  # overflows: reallocate, keep the first 50 entries
    assert cache.get_seq_length() == 200 and cache.capacity >= max(200, 2 * first)
    assert torch.equal(cache.layers[0].keys[:, :, :50], keys_before)
    ref = target.new_cache(capacity=256)  # the same prompt in one forward, never grown
    target.prefill(torch.tensor([prompt]), ref)
    for (k, v), (rk, rv) in zip(_kv(cache), _kv(ref), strict=True):
        assert torch.allclose(k, rk, atol=1e-5) and torch.allclose(v, rv, atol=1e-5)


def test_compaction_moves_only_what_it_must():
    """A fully accepted chain keeps its entries in place: the gather is skipped, only the length
    moves; a rejected first child moves the rest (negative control: the entries do differ)."""
    target = _target()
    cache = target.new_cache()
    target.prefill(torch.tensor([_tokens(8, 4)]), cache)
    keys = cache.layers[0].keys
    before = keys[:, :, :8].clone()
    cache.compact([4], [[0, 1, 2]])
    assert cache.get_seq_length() == 7 and cache.layers[0].keys is keys
    assert torch.equal(keys[:, :, :7], before[:, :, :7])
    cache.compact([2], [[0, 2, 4]])
    assert torch.equal(keys[:, :, 3], before[:, :, 4]) and not torch.equal(keys[:, :, 3], before[:, :, 3])


def test_mask_buffer_is_reused_across_rounds():
    target = _target()
    cache = target.new_cache(capacity=100)
    target.prefill(torch.tensor([_tokens(20, 5)]), cache)
    first = cache.mask(4, 24, torch.float32, target.device)
    second = cache.mask(7, 31, torch.float32, target.device)
    assert first.shape == (1, 1, 4, 24) and second.shape == (1, 1, 7, 31)
    assert first.data_ptr() == second.data_ptr()  # the same memory, allocated once
    assert cache.mask(2, 500, torch.float32, target.device).shape == (1, 1, 2, 500)  # grown on demand


@functools.cache
def _head() -> Eagle3DraftModel:
    return Eagle3DraftModel.from_target(_target(), seed=3)


@pytest.mark.parametrize("tree", [None, TreeConfig(depth=3, top_k=2, total_tokens=5)], ids=["plain", "tree"])
def test_the_cache_grows_with_the_output(tree, monkeypatch):
    """The cache is sized from the prompt and the largest tree, not from max_new_tokens: an output far
    longer than what was reserved grows the buffers and gives the same tokens."""
    prompt = torch.tensor([_tokens(12, 6)])
    decoder = SpeculativeDecoder(_target(), None if tree is None else _head(), tree=tree)
    reserved = decoder.generate(prompt, 150).sequences
    monkeypatch.setattr(rounds_module, "OUTPUT_SLOTS", 1)
    sizes = []
    original = rounds_module.RoundLoop._measure

    def measure(self):
        original(self)
        sizes.append(self.cache.capacity)

    monkeypatch.setattr(rounds_module.RoundLoop, "_measure", measure)
    assert torch.equal(decoder.generate(prompt, 150).sequences, reserved)
    assert sizes[0] == MIN_CAPACITY and sizes[-1] >= 12 + 150  # it started small and grew


def test_drafter_protocol_and_decoder_options(monkeypatch):
    head = _head()
    assert isinstance(Drafter(head, TreeConfig()), RoundDrafter)
    with pytest.raises(TypeError, match="SequenceDrafter"):
        SpeculativeDecoder(_target(), drafter=object())
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append((fn, kw)) or fn)
    SpeculativeDecoder(_target(), head, compile=True)
    assert len(compiled) == 1 and compiled[0][1] == {"dynamic": True}  # the head's step


def test_round_clock_splits_each_round():
    clock = RoundClock(torch.device("cpu"))
    with clock.phase("draft"):
        time.sleep(0.02)
    with clock.phase("other"):
        time.sleep(0.01)
    split = clock.close_round(requests=3)
    assert split.requests == 3 and split.verify_s == 0.0
    assert 0.02 <= split.draft_s < 0.5 and 0.01 <= split.other_s < 0.5
    assert split.total_s == split.draft_s + split.verify_s + split.other_s <= clock.now()
    assert clock.close_round(requests=3).total_s == 0.0  # each round starts from zero


def test_round_split_per_request_and_per_batch():
    """Every request's RoundStats carry the split of the batch round they ran in: the per-request
    rounds of a batch are the batch's rounds, the last ones run by fewer requests."""
    dec = SpeculativeDecoder(_target(), _head(), tree=TreeConfig(depth=3, top_k=2, total_tokens=5))
    prompts = [torch.tensor(_tokens(n, 7 + n)) for n in (5, 9)]
    out = dec.generate_batch(prompts, max_new_tokens=12)
    assert len(out.splits) == out.rounds == max(len(r.rounds) for r in out.results)
    for res in out.results:
        assert [s.committed for s in res.rounds] == res.acceptance_lengths
        for stats, split in zip(res.rounds, out.splits, strict=False):
            assert (stats.draft_s, stats.verify_s, stats.other_s) == (split.draft_s, split.verify_s, split.other_s)
    assert [s.requests for s in out.splits] == sorted((s.requests for s in out.splits), reverse=True)
    one = dec.generate(prompts[0][None], max_new_tokens=12)
    assert sum(r.total_s for r in one.rounds) <= one.total_s - one.prefill_s
    assert one.token_times[0] == one.prefill_s and one.token_times == sorted(one.token_times)
    assert len(one.token_times) == one.new_tokens
