"""The preallocated TargetCache: growth, compaction against a DynamicCache, the mask buffer, plain and
speculative decoding through either cache, and the row conventions of a round (Tree.row, cache_rows)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

from eagle_tree.core.tree import Tree
from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.decoding.decoder import RoundClock, SpeculativeDecoder
from eagle_tree.decoding.drafting import Drafter, DrafterProtocol, TreeConfig
from eagle_tree.models.cache import TargetCache
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


def test_row_conventions():
    assert Tree.row(-1) == 0 and Tree.row(4) == 5
    assert Tree.cache_rows([]) == [0] and Tree.cache_rows([0, 2, 5]) == [0, 1, 3, 6]
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
    prompt = _tokens(200, 1)
    target.prefill(torch.tensor([prompt[:50]]), cache)
    first = cache.capacity
    keys_before = cache.layers[0].keys[:, :, :50].clone()
    target.prefill(torch.tensor([prompt[50:]]), cache)  # overflows: reallocate, keep the first 50 entries
    assert cache.get_seq_length() == 200 and cache.capacity >= max(200, 2 * first)
    assert torch.equal(cache.layers[0].keys[:, :, :50], keys_before)
    ref = DynamicCache()
    target.prefill(torch.tensor([prompt]), ref)
    for (k, v), (rk, rv) in zip(_kv(cache), _kv(ref), strict=True):
        assert torch.allclose(k, rk, atol=1e-5) and torch.allclose(v, rv, atol=1e-5)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("accepted", [[1, 4], [0, 2, 5], [], [0]])
def test_verify_and_compact_match_a_dynamic_cache(impl, accepted):
    """Same logits from verify and the same entries after compaction, whichever cache is passed."""
    target = _target(impl)
    tree, prefix = Tree(PARENTS, _tokens(len(PARENTS), 2)), _tokens(9, 3)
    caches = [target.new_cache(), DynamicCache()]
    outs = []
    for cache in caches:
        target.prefill(torch.tensor([prefix[:-1]]), cache)
        outs.append(target.verify(prefix[-1], tree, cache))
        target.compact_cache(cache, len(prefix) - 1, Tree.cache_rows(accepted))
        assert cache.get_seq_length() == len(prefix) + len(accepted)
    assert isinstance(caches[0], TargetCache)
    assert torch.allclose(outs[0].logits, outs[1].logits, atol=1e-5)
    for (k, v), (rk, rv) in zip(_kv(caches[0]), _kv(caches[1]), strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)


def test_compaction_moves_only_what_it_must():
    """A fully accepted chain keeps its entries in place: the gather is skipped, the crop only moves
    the length; a rejected first child moves the rest (negative control: the entries do differ)."""
    target = _target()
    cache = target.new_cache()
    target.prefill(torch.tensor([_tokens(8, 4)]), cache)
    keys = cache.layers[0].keys
    before = keys[:, :, :8].clone()
    target.compact_cache(cache, 4, [0, 1, 2])
    assert cache.get_seq_length() == 7 and cache.layers[0].keys is keys
    assert torch.equal(keys[:, :, :7], before[:, :, :7])
    target.compact_cache(cache, 2, [0, 2, 4])
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
def test_decoding_with_a_dynamic_cache_equals_the_preallocated_one(tree, monkeypatch):
    prompt = torch.tensor([_tokens(12, 6)])
    target = _target()
    decoder = SpeculativeDecoder(target, None if tree is None else _head(), tree=tree)
    preallocated = decoder.generate(prompt, 20).sequences
    monkeypatch.setattr(TargetModel, "new_cache", lambda self, capacity=0: DynamicCache())
    assert torch.equal(SpeculativeDecoder(target, None if tree is None else _head(), tree=tree).generate(prompt, 20)
                       .sequences, preallocated)


def test_drafter_protocol_and_decoder_options(monkeypatch):
    head = _head()
    assert isinstance(Drafter(head, TreeConfig()), DrafterProtocol)
    with pytest.raises(TypeError, match="DrafterProtocol"):
        SpeculativeDecoder(_target(), drafter=object())
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append((fn, kw)) or fn)
    SpeculativeDecoder(_target(), head, compile=True)
    assert len(compiled) == 1 and compiled[0][1] == {"dynamic": True}  # the head's step


def test_round_clock_files_each_round():
    from eagle_tree.decoding.decoder import GenerateOutput

    result = GenerateOutput(torch.zeros(1, 3, dtype=torch.long), 3)
    clock = RoundClock(result, torch.device("cpu"))
    clock.first_token()
    for name in ("draft", "verify", "other"):
        with clock.phase(name):
            torch.ones(100).sum()
    clock.close_round(accepted=2, committed=3, tree_size=4)
    clock.close()
    (stats,) = result.rounds
    assert (stats.accepted, stats.committed, stats.tree_size) == (2, 3, 4)
    assert min(stats.draft_s, stats.verify_s, stats.other_s) > 0 and stats.total_s <= result.total_s
    assert len(result.token_times) == 1 + 3 and result.token_times == sorted(result.token_times)
