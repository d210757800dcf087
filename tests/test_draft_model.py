"""The EAGLE-3 head: construction from a target, the reduced draft vocabulary (d2t / t2d), checkpoints in
eagle-tree's format and in the public EAGLE-3 layout, and the refusals (wrong target, broken
checkpoint, unbound head).

The engine layouts (SGLang / vLLM export, golden configs) are tested in test_export.py; here the
public EAGLE-3 key layout is written by hand, key by key, as a released head would hold it.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_tree import SamplingConfig
from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import Drafter, TreeConfig
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.head_config import Eagle3Config, default_feature_layers, vocab_maps
from eagle_tree.models.target import TargetModel
from tests.helpers import PastKV

PROMPT = [4, 90, 17, 3, 66, 21, 8]
DRAFT_VOCAB = [100, 3, 7, 7, 64, 8, 21, 90, 5, 0, 127, 44, 17, 66, 12, 30]  # unsorted, one duplicate
PUBLIC_KEYS = [
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
]



@functools.cache
def _hf(**config):
    """Tiny llama (vocab 128, hidden 64, 4 heads / 2 kv heads, 4 layers) unless overridden."""
    return tiny_causal_lm("llama", initializer_range=0.1, **config)


def _target(**config) -> TargetModel:
    return TargetModel(_hf(**config))


def _drafts(head: Eagle3DraftModel, target: TargetModel):
    """Draft logits at the root and two proposals (deterministic tree, sampled tree with a fixed seed)."""
    out = target.prefill(torch.tensor([PROMPT]), target.new_cache())
    pairs = (out.features, torch.tensor([PROMPT[1:] + [PROMPT[0]]]))
    results = []
    for cfg, seed in ((TreeConfig(depth=3, top_k=3, total_tokens=8), None),
                      (TreeConfig(depth=2, top_k=3, total_tokens=12, sampled=True), 5)):
        d = Drafter(head, cfg)
        d.catch_up(*pairs)
        g = None if seed is None else torch.Generator().manual_seed(seed)
        p = d.propose(SamplingConfig(temperature=1.0), [g])[0]
        results.append((p.tree.parents, p.tree.tokens, p.draft_probs))
    return d.logits[0], results


def _assert_same_drafts(a, b) -> None:
    (logits_a, props_a), (logits_b, props_b) = a, b
    assert torch.equal(logits_a, logits_b)
    for (pa, ta, qa), (pb, tb, qb) in zip(props_a, props_b, strict=True):
        assert (pa, ta) == (pb, tb)
        assert (qa is None and qb is None) or torch.equal(qa, qb)


# ---------------------------------------------------------------------------------- construction


@pytest.mark.parametrize("wrapped", [True, False], ids=["TargetModel", "hf-model"])
def test_from_target_shapes_and_config(wrapped):
    target = _target()
    head = Eagle3DraftModel.from_target(target if wrapped else target.model)
    cfg, tc = head.config, target.model.config
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.vocab_size, cfg.draft_vocab_size) == (64, 64, 128, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.target_num_layers == 4 and cfg.feature_layers == default_feature_layers(4) == target.feature_layers
    assert cfg.intermediate_size == tc.intermediate_size
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    assert shapes["fc.weight"] == (64, 3 * 64)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4 * 16, 2 * 64)  # attention reads [embedding; feature]
    assert shapes["midlayer.self_attn.k_proj.weight"] == shapes["midlayer.self_attn.v_proj.weight"] == (2 * 16, 128)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (64, 64)
    assert shapes["lm_head.weight"] == (128, 64)
    assert shapes["d2t"] == (128,) and shapes["t2d"] == (128,)
    assert torch.equal(head.d2t, torch.zeros(128, dtype=torch.long)) and bool(head.t2d.all())
    assert torch.equal(head.embed_tokens.weight, target.model.get_input_embeddings().weight)
    assert not head.embed_tokens.weight.requires_grad
    assert all(p.dtype == torch.float32 for p in head.parameters())
    # the fused feature and the logits have the documented shapes
    with torch.no_grad():
        hidden = head.fuse(torch.randn(1, 5, 3 * 64))
        mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
        past = PastKV()
        out, logits = head.step(hidden, torch.tensor([PROMPT[:5]]), torch.arange(5)[None], past, mask)
    assert out.shape == (1, 5, 64) and logits.shape == (1, 5, 128) and past.k.shape == past.v.shape == (1, 2, 5, 16)


def test_from_target_custom_layers_and_seed():
    target = _target(num_layers=8)
    a = Eagle3DraftModel.from_target(target.model, layers=(1, 3, 6), seed=3)
    b = Eagle3DraftModel.from_target(target.model, layers=(1, 3, 6), seed=3)
    assert a.config.feature_layers == (1, 3, 6)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match="out of range for a target with 8 layers"):
        Eagle3DraftModel.from_target(target.model, layers=(1, 3, 8))


@pytest.mark.parametrize(
    ("layers", "why"),
    [((6, 1, 3), "not ascending: engines capture the layers in layer order"),
     ((2, 3, 3), "repeat a layer: engines capture each layer once"),
     ((0, 3, 5), "include layer 0: the input of layer 0 is the token embedding"),
     ((1, 2), "exactly 3 target layers")],
)
def test_feature_layers_an_engine_cannot_capture_are_refused(layers, why):
    """At head creation (from_target and the config itself) with the reason; import and export use the
    same check (tests/test_export.py)."""
    with pytest.raises(ValueError, match=why):
        Eagle3DraftModel.from_target(_target(num_layers=8).model, layers=layers)
    with pytest.raises(ValueError, match=why):
        _config(feature_layers=layers)


def test_default_feature_layers_of_small_targets_are_three_distinct_layers():
    for n in range(4, 64):
        low, mid, high = default_feature_layers(n)
        assert 1 <= low < mid < high <= n - 1
        if n >= 7:  # the engines' own rule wherever it gives three distinct layers
            assert (low, mid, high) == (2, n // 2, n - 3)
    assert [default_feature_layers(n) for n in (4, 5, 6)] == [(1, 2, 3), (2, 3, 4), (2, 3, 4)]
    with pytest.raises(ValueError, match="at least 4 layers"):
        default_feature_layers(3)
    head = Eagle3DraftModel.from_target(_target(num_layers=6))
    assert head.config.feature_layers == (2, 3, 4)


def test_reduced_draft_vocabulary_maps():
    head = Eagle3DraftModel.from_target(_target(), draft_vocab=DRAFT_VOCAB)
    ids = sorted(set(DRAFT_VOCAB))
    assert head.config.draft_vocab_size == len(ids) == head.lm_head.weight.shape[0]
    assert head.draft_to_target.tolist() == ids  # draft id i is target id i + d2t[i]
    assert torch.equal(head.d2t, torch.tensor(ids) - torch.arange(len(ids)))
    assert head.t2d.nonzero().flatten().tolist() == ids
    # drafts speak target ids from the draft vocabulary only
    _, props = _drafts(head, _target())
    for _, tokens, _ in props:
        assert set(tokens) <= set(ids)
    q = props[1][2]
    assert q is not None and float(q[:, [t for t in range(128) if t not in ids]].abs().sum()) == 0.0


@pytest.mark.parametrize("vocab", [[], [-1, 3], [5, 128]])
def test_draft_vocab_out_of_range_is_refused(vocab):
    with pytest.raises(ValueError, match="draft_vocab"):
        Eagle3DraftModel.from_target(_target(), draft_vocab=vocab)


def _config(**changes) -> Eagle3Config:
    fields = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=128, draft_vocab_size=15, target_hidden_size=64, target_num_layers=4,
                  feature_layers=(1, 2, 3))
    fields.update(changes)
    return Eagle3Config(**fields)


def _bad_maps():
    d2t, t2d = vocab_maps(torch.tensor(sorted(set(DRAFT_VOCAB))), 128)
    other = t2d.clone()
    other[0], other[1] = False, True  # marks id 1 instead of id 0
    return {
        "t2d-marks-other-ids": (d2t, other),
        "d2t-outside-vocab": (d2t + 200, t2d),
        "d2t-wrong-length": (d2t[:-1], t2d),
        "t2d-wrong-length": (d2t, t2d[:-1]),
        "t2d-too-many": (d2t, t2d | (torch.arange(128) == 2)),
    }


@pytest.mark.parametrize("case", list(_bad_maps()))
def test_inconsistent_vocab_maps_are_refused(case):
    d2t, t2d = _bad_maps()[case]
    with pytest.raises(ValueError, match="d2t|t2d"):
        Eagle3DraftModel(_config(), d2t, t2d)


def test_config_refuses_a_draft_vocab_larger_than_the_target_vocab():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        _config(draft_vocab_size=129)
    with pytest.raises(ValueError, match="3 target layers"):
        _config(feature_layers=(1, 2))


# ------------------------------------------------------------------------------------ checkpoints


def test_save_and_load_round_trip_gives_identical_drafts(tmp_path):
    target = _target()
    head = Eagle3DraftModel.from_target(target, draft_vocab=DRAFT_VOCAB, seed=1)
    head.save_pretrained(tmp_path / "head")
    files = sorted(p.name for p in (tmp_path / "head").iterdir())
    assert files == ["config.json", "model.safetensors"]
    saved = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert sorted(saved) == sorted(PUBLIC_KEYS)  # the public layout; the target's embedding is not saved
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 15

    loaded = Eagle3DraftModel.from_pretrained(tmp_path / "head", target=target)
    assert loaded.config == head.config
    state, original = loaded.state_dict(), head.state_dict()
    assert state.keys() == original.keys() and all(torch.equal(state[k], original[k]) for k in state)
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    _assert_same_drafts(_drafts(loaded, target), _drafts(head, target))

    head.save_pretrained(tmp_path / "head")  # saving over an existing folder replaces it
    again = Eagle3DraftModel.from_pretrained(tmp_path / "head", target=target)
    _assert_same_drafts(_drafts(again, target), _drafts(head, target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no temporary folders left behind


def _public_checkpoint(path, target: TargetModel, draft_ids: list[int], config_extra: dict, bin_file: bool = False):
    """A head written by hand in the public EAGLE-3 layout: the key list above and an official-style
    config.json (a one-layer Llama config in transformers 4.x keys plus draft_vocab_size)."""
    g = torch.Generator().manual_seed(11)
    h, nh, nkv, hd, inter, vd = 64, 4, 2, 16, 128, len(draft_ids)
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, nh * hd),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (vd, h),
    }
    state = {k: (1.0 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1 else 0.1 * torch.randn(s, generator=g)
             for k, s in shapes.items()}
    ids = torch.tensor(sorted(draft_ids))
    state["d2t"] = ids - torch.arange(vd)  # target id = draft id + d2t[draft id]
    state["t2d"] = torch.zeros(128, dtype=torch.bool).index_fill(0, ids, True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": h,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": 512,
        "num_attention_heads": nh,
        "num_hidden_layers": 1,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "pretraining_tp": 1,
        "rms_norm_eps": target.model.config.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": target.model.config.rope_parameters["rope_theta"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "vocab_size": 128,
        "draft_vocab_size": vd,
        **config_extra,
    }
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if bin_file:
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return state


@pytest.mark.parametrize(
    "style, extra, bin_file",
    [
        ("official", {}, False),  # no layer ids: the target's default layers are meant
        ("official-bin", {}, True),
        ("sglang-ids", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, False),
        ("target-hidden-size", {"target_hidden_size": 64}, False),
    ],
)
def test_public_eagle3_layout_loads(tmp_path, style, extra, bin_file):
    target = _target(num_layers=8)  # the engines' default layers (2, 4, 5) are valid from 7 layers
    draft_ids = list(range(0, 128, 4))
    state = _public_checkpoint(tmp_path / "head", target, draft_ids, extra, bin_file)
    head = Eagle3DraftModel.from_pretrained(tmp_path / "head", target=target)
    assert head.config.feature_layers == (2, 4, 5) == default_feature_layers(8)  # SGLang ids name the layer before
    assert head.config.draft_vocab_size == 32 and head.draft_to_target.tolist() == draft_ids
    loaded = head.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    # it drafts for the target: greedy speculation still equals plain greedy decoding
    prompt = torch.tensor([PROMPT])
    plain = SpeculativeDecoder(target).generate(prompt, max_new_tokens=8)
    spec = SpeculativeDecoder(target, head, tree=TreeConfig(depth=2, top_k=2, total_tokens=4)).generate(prompt, 8)
    assert torch.equal(spec.sequences, plain.sequences)
    _, props = _drafts(head, target)
    assert all(set(tokens) <= set(draft_ids) for _, tokens, _ in props)


def test_official_config_without_layers_needs_the_target(tmp_path):
    _public_checkpoint(tmp_path / "head", _target(), list(range(32)), {})
    with pytest.raises(ValueError, match="target"):
        Eagle3DraftModel.from_pretrained(tmp_path / "head")


def test_official_config_without_layers_on_a_small_target_is_refused(tmp_path):
    """Below 7 layers the engines' default layers (2, L//2, L-3) repeat a layer: no engine can serve it."""
    _public_checkpoint(tmp_path / "head", _target(), list(range(32)), {})
    with pytest.raises(ValueError, match=r"on a 6-layer target the engines' default layers .* are only \[2, 3\]"):
        Eagle3DraftModel.from_pretrained(tmp_path / "head", target=_target(num_layers=6))


def _broken(state: dict, case: str) -> dict:
    state = dict(state)
    if case == "missing-key":
        del state["midlayer.hidden_norm.weight"]
    elif case == "wrong-shape":
        state["fc.weight"] = torch.zeros(64, 2 * 64)
    elif case == "wrong-lm-head-rows":
        state["lm_head.weight"] = torch.zeros(17, 64)
    elif case == "unexpected-key":
        state["midlayer.extra.weight"] = torch.zeros(3)
    elif case == "only-d2t":
        del state["t2d"]
    elif case == "maps-disagree":
        state["t2d"] = torch.zeros(128, dtype=torch.bool).index_fill(0, torch.arange(15), True)
    return state


@pytest.mark.parametrize(
    "case, message",
    [("missing-key", "missing keys"), ("wrong-shape", "fc.weight has shape"),
     ("wrong-lm-head-rows", "lm_head.weight has shape"), ("unexpected-key", "unexpected keys"),
     ("only-d2t", "d2t / t2d"), ("maps-disagree", "disagree")],
)
def test_broken_checkpoint_is_refused(tmp_path, case, message):
    target = _target()
    Eagle3DraftModel.from_target(target, draft_vocab=DRAFT_VOCAB).save_pretrained(tmp_path / "head")
    weights = tmp_path / "head" / "model.safetensors"
    save_file(_broken(load_file(str(weights)), case), str(weights))
    with pytest.raises(ValueError, match=message):
        Eagle3DraftModel.from_pretrained(tmp_path / "head", target=target)


# -------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "other, message",
    [
        (dict(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64), "hidden size"),
        (dict(vocab_size=96), "vocabulary"),
        (dict(num_layers=6), "layers"),
    ],
    ids=["hidden-size", "vocabulary", "layer-count"],
)
def test_head_of_another_target_is_refused(other, message):
    head = Eagle3DraftModel.from_target(_target())
    stranger = _hf(**other)
    with pytest.raises(ValueError, match=f"does not belong to this target.*{message}"):
        head.bind_target(stranger)
    with pytest.raises(ValueError, match=f"does not belong to this target.*{message}"):
        SpeculativeDecoder(stranger, head)
    with pytest.raises(ValueError, match="does not belong to this target"):
        SpeculativeDecoder(TargetModel(stranger, feature_layers=(1, 2, 3)), head)


def test_feature_layers_must_match_the_target_wrapper():
    head = Eagle3DraftModel.from_target(_target())  # layers (1, 2, 3)
    with pytest.raises(ValueError, match="feature layers"):
        SpeculativeDecoder(TargetModel(_hf(num_layers=6), feature_layers=(1, 2, 4)), head)


def test_unbound_head_raises_a_clear_error(tmp_path):
    target = _target()
    Eagle3DraftModel.from_target(target).save_pretrained(tmp_path / "head")
    for head in (Eagle3DraftModel(_config(draft_vocab_size=128)), Eagle3DraftModel.from_pretrained(tmp_path / "head")):
        drafter = Drafter(head, TreeConfig(depth=2, top_k=2, total_tokens=4))
        out = target.prefill(torch.tensor([PROMPT]), target.new_cache())
        with pytest.raises(RuntimeError, match="bind_target"):
            drafter.catch_up(out.features, torch.tensor([PROMPT[1:] + [0]]))
        head.bind_target(target)  # binding (or SpeculativeDecoder, which binds) makes it usable
        drafter.catch_up(out.features, torch.tensor([PROMPT[1:] + [0]]))
        assert drafter.logits[0].shape == (128,)
