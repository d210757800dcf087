"""TargetModel on tiny float32 models of every family: features, tree verification, cache compaction.

Tolerance: every comparison of logits, features and cache entries uses atol = 1e-5 (float32; the
observed differences are ~1e-6). Each exactness check has a negative control showing that a wrong
mask / position / cache would be caught at that tolerance.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import LlamaConfig

from eagle_tree.core.tree import Tree
from eagle_tree.data.tiny import FAMILIES, tiny_causal_lm
from eagle_tree.models.grouped_attention import GROUPED_SDPA, grouped_sdpa_attention, register
from eagle_tree.models.head_config import default_feature_layers
from eagle_tree.models.target import TargetModel, TargetOutput

ATOL = 1e-5
VOCAB = 128

register()
# (family, attention implementation): all families under eager, llama under sdpa and grouped sdpa too
CASES = [(f, "eager") for f in FAMILIES] + [("llama", "sdpa"), ("llama", GROUPED_SDPA), ("qwen2", GROUPED_SDPA)]
CASE_IDS = [f"{f}-{impl}" for f, impl in CASES]

# depth 3, several children per node: 3 children of the root, 2-3 children of inner nodes
PARENTS = [-1, -1, -1, 0, 0, 0, 1, 1, 3, 3, 4, 6, 6]


@functools.cache
def _model(family: str, impl: str = "eager", **config):
    return tiny_causal_lm(family, attn_implementation=impl, **config)


def _target(family: str, impl: str = "eager", feature_layers=(1, 2, 3), **config) -> TargetModel:
    return TargetModel(_model(family, impl, **config), feature_layers)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _reference(target: TargetModel, *sequences: list[int]) -> TargetOutput:
    """Plain causal forward without a cache, hidden states from the model itself: (B, T, ...) for B
    sequences, right-padded with token 0 (causal attention: padding never affects earlier positions)."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True, use_cache=False)
    features = torch.cat([out.hidden_states[i] for i in target.feature_layers], dim=-1)
    return TargetOutput(logits=out.logits.float(), features=features)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=ATOL, rtol=0)


def _prefilled(target: TargetModel, prefix: list[int]):
    """The decoder invariant: the cache holds the prefix minus its last token (the root)."""
    cache = target.new_cache()
    target.prefill(torch.tensor([prefix[:-1]]), cache)
    return cache


# ------------------------------------------------------------------------------------------ features


def test_default_feature_layers():
    assert default_feature_layers(32) == (2, 16, 29)
    assert TargetModel(_model("llama")).feature_layers == (1, 2, 3)  # 4 layers: three distinct layers
    assert TargetModel(tiny_causal_lm(num_layers=8)).feature_layers == (2, 4, 5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layers", [(1, 2, 3), (1, 3, 5), None])
def test_features_are_hidden_states_entering_the_layers(family, layers):
    target = TargetModel(_model(family, num_layers=6) if layers == (1, 3, 5) else _model(family), layers)
    tokens = _tokens(9, seed=1)
    out = target.forward(torch.tensor([tokens]), target.new_cache())
    ref = _reference(target, tokens)
    assert out.features.shape == (1, 9, 3 * target.hidden_size)
    assert out.logits.shape == (1, 9, VOCAB) and out.logits.dtype == torch.float32
    assert _close(out.features, ref.features) and _close(out.logits, ref.logits)
    # the hooks live for one forward only
    assert all(len(layer._forward_pre_hooks) == 0 for layer in target._layers)


def test_attributes():
    target = TargetModel(_model("qwen3"))
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 64, VOCAB)
    assert target.dtype == torch.float32 and target.device.type == "cpu"
    assert target.embed_tokens is target.model.get_input_embeddings()
    assert target.config is target.model.config


# ------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("family,impl", CASES, ids=CASE_IDS)
def test_prefill_then_single_tokens_match_full_forward(family, impl):
    target = _target(family, impl)
    tokens = _tokens(10, seed=2)
    cache = target.new_cache()
    outs = [target.prefill(torch.tensor([tokens[:6]]), cache)]
    for t in tokens[6:]:
        outs.append(target.forward(torch.tensor([[t]]), cache))
    assert cache.get_seq_length() == 10
    ref = _reference(target, tokens)
    assert _close(torch.cat([o.logits for o in outs], 1), ref.logits)
    assert _close(torch.cat([o.features for o in outs], 1), ref.features)


# -------------------------------------------------------------------------------------------- verify


def _check_verify_matches_paths(target: TargetModel, prefix: list[int], tree: Tree) -> None:
    cache = _prefilled(target, prefix)
    out = target.verify([prefix[-1]], [tree], cache)
    assert out.logits.shape == (1, len(tree) + 1, VOCAB)
    assert cache.get_seq_length() == len(prefix) + len(tree)
    # one causal forward per root-to-leaf path (batched) covers every node on that path
    ref = _reference(target, *(prefix + [tree.tokens[i] for i in path] for path in tree.paths))
    checked = set()
    for b, path in enumerate(tree.paths):
        for step, node in enumerate([-1, *path]):  # -1: the root, at the last prefix position
            t = len(prefix) - 1 + step
            assert _close(out.logits[0, node + 1], ref.logits[b, t]), f"logits of node {node}"
            assert _close(out.features[0, node + 1], ref.features[b, t]), f"features of node {node}"
            checked.add(node)
    assert checked == {-1, *range(len(tree))}


@pytest.mark.parametrize("family,impl", CASES, ids=CASE_IDS)
def test_tree_verification_matches_causal_forward_of_each_path(family, impl):
    target = _target(family, impl)
    tree = Tree(PARENTS, _tokens(len(PARENTS), seed=3))
    assert tree.max_depth == 3 and max(len(c) for c in tree.children.values()) == 3
    _check_verify_matches_paths(target, _tokens(8, seed=4), tree)


def test_tree_verification_with_a_binding_sliding_window():
    target = _target("mistral", sliding_window=4)
    assert target.sliding_window == 4
    _check_verify_matches_paths(target, _tokens(8, seed=5), Tree(PARENTS, _tokens(len(PARENTS), seed=6)))


def test_verification_negative_control():
    """A causal (chain) mask over the tree nodes is wrong for a tree; the check above must see it."""
    target = _target("llama")
    prefix, tree = _tokens(8, seed=4), Tree(PARENTS, _tokens(len(PARENTS), seed=3))
    good = target.verify([prefix[-1]], [tree], _prefilled(target, prefix))
    cache = _prefilled(target, prefix)
    past, t = cache.get_seq_length(), len(tree) + 1
    positions = past + torch.cat([torch.zeros(1, dtype=torch.long), tree.position_offsets()])
    causal = torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)[None, None]
    wrong = target.forward(torch.tensor([[prefix[-1], *tree.tokens]]), cache, positions[None], causal)
    assert _close(wrong.logits[:, :2], good.logits[:, :2])  # the root and node 0 see the same things
    assert (wrong.logits - good.logits).abs().amax() > 1e-3


# ------------------------------------------------------------------------------------------- compact


def _layer_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = cache.get_seq_length()  # a TargetCache layer holds a buffer filled up to the cache length
    return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in cache.layers]


# every family and implementation with a deep path whose entries all move; llama with the other shapes
COMPACT_CASES = [(f, impl, [1, 6, 11]) for f, impl in CASES] + [
    ("llama", "eager", accepted) for accepted in ([0, 3, 8], [0, 5], [2], [])
]


@pytest.mark.parametrize(
    "family,impl,accepted", COMPACT_CASES, ids=[f"{f}-{i}-{a}" for f, i, a in COMPACT_CASES]
)
def test_compacted_cache_equals_recomputed_cache(family, impl, accepted):
    target = _target(family, impl)
    tree = Tree(PARENTS, _tokens(len(PARENTS), seed=7))
    # accepted is a root-to-node path
    assert all(tree.parents[b] == a for a, b in zip([-1, *accepted], accepted, strict=False))
    prefix = _tokens(7, seed=8)
    cache = _prefilled(target, prefix)
    past = cache.get_seq_length()
    target.verify([prefix[-1]], [tree], cache)
    cache.compact([past], [Tree.cache_offsets(accepted)])

    committed = prefix + [tree.tokens[a] for a in accepted]
    ref_cache = target.new_cache()
    target.prefill(torch.tensor([committed]), ref_cache)
    assert cache.get_seq_length() == ref_cache.get_seq_length() == len(committed)
    assert len(cache.layers) == target.num_layers
    for (k, v), (rk, rv) in zip(_layer_kv(cache), _layer_kv(ref_cache), strict=True):
        assert k.shape == rk.shape and _close(k, rk) and _close(v, rv)

    nxt = torch.tensor([[5, 17]])
    out, ref = target.forward(nxt, cache), target.forward(nxt, ref_cache)
    assert _close(out.logits, ref.logits) and _close(out.features, ref.features)


def test_compaction_negative_control():
    """Cropping without gathering keeps the wrong entries; the cache comparison must see it."""
    target = _target("llama")
    tree, prefix = Tree(PARENTS, _tokens(len(PARENTS), seed=7)), _tokens(7, seed=8)
    cache = _prefilled(target, prefix)
    past = cache.get_seq_length()
    target.verify([prefix[-1]], [tree], cache)
    cache.set_lengths([past + 3])  # root + the first two nodes, not the path root -> 1 -> 6
    ref_cache = target.new_cache()
    target.prefill(torch.tensor([prefix + [tree.tokens[1], tree.tokens[6]]]), ref_cache)
    assert cache.get_seq_length() == past + 3 == ref_cache.get_seq_length()
    assert not _close(_layer_kv(cache)[0][0], _layer_kv(ref_cache)[0][0])


def test_compact_rejects_bad_offsets():
    target = _target("llama")
    cache = target.new_cache()
    target.prefill(torch.tensor([_tokens(6, seed=9)]), cache)
    with pytest.raises(ValueError, match="strictly ascending"):
        cache.compact([2], [[0, 2, 1]])
    with pytest.raises(ValueError, match="outside the cache of length 6"):
        cache.compact([2], [[0, 4]])
    with pytest.raises(ValueError, match="one start and one offset list per request"):
        cache.compact([2, 3], [[0], [0]])
    assert cache.get_seq_length() == 6


# ------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "layers,pattern",
    [
        ((0, 1, 3), r"include layer 0: the input of layer 0 is the token embedding"),
        ((-1, 1, 2), r"include layer -1"),
        ((1, 2, 4), r"out of range for a target with 4 layers \(valid: 1 to 3\)"),
        ((1, 1, 2), "repeat a layer"),
        ((3, 1, 2), "are not ascending"),
        ((1, 2), "exactly 3 target layers"),
        ((0, 1, 2, 3), "exactly 3 target layers"),
    ],
)
def test_bad_feature_layers_are_rejected(layers, pattern):
    with pytest.raises(ValueError, match=pattern):
        TargetModel(_model("llama"), layers)


def test_default_feature_layers_need_three_layers():
    with pytest.raises(ValueError, match=r"at least 4 layers.*2 decoder layers"):
        TargetModel(tiny_causal_lm(num_layers=2))


def test_attention_without_custom_masks_is_rejected():
    with pytest.raises(ValueError, match="'flex_attention'.*attn_implementation='eager', 'sdpa' or"):
        TargetModel(tiny_causal_lm(attn_implementation="flex_attention"))
    model = tiny_causal_lm()
    model.config._attn_implementation = "flash_attention_2"  # as if loaded that way (no flash-attn here)
    with pytest.raises(ValueError, match="'flash_attention_2'"):
        TargetModel(model)


def test_mixed_sliding_and_full_layers_are_rejected():
    model = tiny_causal_lm("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert set(model.config.layer_types) == {"full_attention", "sliding_attention"}
    with pytest.raises(ValueError, match="all 'full_attention' or all 'sliding_attention'"):
        TargetModel(model)


class _NoCacheLM(torch.nn.Module):
    """A causal LM whose forward takes only token ids (no mask, positions or cache)."""

    def __init__(self):
        super().__init__()
        self.config = LlamaConfig(vocab_size=VOCAB, hidden_size=8, num_attention_heads=2, num_hidden_layers=4)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


def test_model_without_mask_positions_or_cache_inputs_is_rejected():
    with pytest.raises(TypeError, match=r"lacks the inputs \['attention_mask', 'position_ids', 'cache'\]"):
        TargetModel(_NoCacheLM())


def test_from_pretrained_local_folder(tmp_path):
    _model("qwen2").save_pretrained(tmp_path)
    target = TargetModel.from_pretrained(str(tmp_path), feature_layers=(1, 2, 3), attn_implementation="eager")
    assert target.feature_layers == (1, 2, 3) and not target.model.training
    tokens = _tokens(5, seed=10)
    out = target.prefill(torch.tensor([tokens]), target.new_cache())
    assert _close(out.logits, _reference(TargetModel(_model("qwen2"), (1, 2, 3)), tokens).logits)


def test_forward_masks_and_hook_cleanup():
    target = _target("llama")
    tokens = torch.tensor([_tokens(6, seed=11)])
    plain = target.forward(tokens, target.new_cache())
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    assert _close(target.forward(tokens, target.new_cache(), attention_mask=causal).logits, plain.logits)
    with pytest.raises(ValueError, match=r"\(B or 1, 1, T, past \+ T\)"):
        target.forward(tokens, target.new_cache(), attention_mask=causal[..., :5])
    with pytest.raises(IndexError):  # token id out of the vocabulary: fails inside the model
        target.forward(torch.tensor([[VOCAB + 1]]), target.new_cache())
    assert all(len(layer._forward_pre_hooks) == 0 for layer in target._layers)


# --------------------------------------------------------------------------- grouped-query attention


def _grouped_and_sdpa(family: str):
    return _target(family, GROUPED_SDPA), _target(family, "sdpa")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_grouped_sdpa_verifies_exactly_as_sdpa(family):
    """Packing the query groups (no repeat of the cache) gives bit-identical logits and features to
    transformers' sdpa: one request with a tree, and two requests of different lengths (a mask per request)."""
    grouped, sdpa = _grouped_and_sdpa(family)
    assert grouped.model.config.num_attention_heads > grouped.model.config.num_key_value_heads  # GQA
    tree = Tree(PARENTS, _tokens(len(PARENTS), seed=3))
    prefix = _tokens(9, seed=4)
    outs = [m.verify([prefix[-1]], [tree], _prefilled(m, prefix)) for m in (grouped, sdpa)]
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].features, outs[1].features)
    prompts = [_tokens(7, seed=5), _tokens(4, seed=6)]
    trees = [tree, Tree([-1, 0, 0], _tokens(3, seed=7))]
    batched = []
    for m in (grouped, sdpa):
        cache = m.new_cache(requests=2)
        m.prefill(prompts, cache)
        batched.append(m.verify([p[-1] for p in prompts], trees, cache))
    assert torch.equal(batched[0].logits, batched[1].logits)


def test_grouped_sdpa_negative_control():
    """Query heads packed in the wrong order (kv heads and groups swapped) change the outputs: the
    comparison above can fail."""
    model = _model("llama", "sdpa")
    attn = model.model.layers[0].self_attn
    groups = attn.num_key_value_groups
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=g)
    k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(2))
    mask = torch.zeros(1, 1, 5, 9).masked_fill(torch.rand(1, 1, 5, 9, generator=g) < 0.3, float("-inf"))
    mask[..., -5:] = 0.0
    right, _ = grouped_sdpa_attention(attn, q, k, v, mask, scaling=0.25)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ref, _ = sdpa_attention_forward(attn, q, k, v, mask, scaling=0.25)
    assert groups == 2 and torch.allclose(right, ref, atol=1e-6, rtol=0)
    swapped = q.reshape(1, groups, 2, 5, 16).transpose(1, 2).reshape(1, 4, 5, 16)  # head order g*r mixed up
    wrong, _ = grouped_sdpa_attention(attn, swapped, k, v, mask, scaling=0.25)
    assert not torch.allclose(wrong, ref, atol=1e-3, rtol=0)
    one = grouped_sdpa_attention(attn, q[:, :, :1], k, v, None, scaling=0.25)[0]  # one token: transformers' path
    assert torch.allclose(one, sdpa_attention_forward(attn, q[:, :, :1], k, v, None, scaling=0.25)[0], atol=1e-6)


def test_from_pretrained_uses_grouped_sdpa_by_default(tmp_path):
    _model("llama").save_pretrained(tmp_path)
    target = TargetModel.from_pretrained(str(tmp_path), feature_layers=(1, 2, 3))
    assert target.model.config._attn_implementation == GROUPED_SDPA


def test_grouped_rows_script_times_both_and_checks_identical_logits(tmp_path, capsys):
    from tests.helpers import load_script

    _model("llama").save_pretrained(tmp_path)
    module = load_script("decode/grouped_rows.py")
    module.main(["--target", str(tmp_path), "--sizes", "1", "4", "--past", "12", "--repeats", "1", "--threads", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 12 |")]
    assert len(rows) == 2 and all(row.endswith("| yes |") for row in rows)
    with pytest.raises(SystemExit):
        module.main(["--sizes", "0"])
