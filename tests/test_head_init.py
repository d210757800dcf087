"""Initialisation of a head from its target's weights (models/head_init.py, ``from_target(init=...)``)."""

from __future__ import annotations

import functools

import pytest
import torch

from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.head_init import INIT_PARTS, check_init_parts
from eagle_tree.models.target import TargetModel

DRAFT_VOCAB = [0, 3, 5, 7, 8, 12, 17, 21, 30, 44, 64, 66, 90, 100, 127]


@functools.cache
def _hf():
    return tiny_causal_lm("llama", initializer_range=0.1)


def _target(layers=(1, 2, 3)) -> TargetModel:
    return TargetModel(_hf(), feature_layers=layers)


def _head(init: str, **kw) -> Eagle3DraftModel:
    return Eagle3DraftModel.from_target(_target(), draft_vocab=DRAFT_VOCAB, init=init, **kw)


def _target_logit_lens(hf, x: torch.Tensor) -> torch.Tensor:
    """The target's logits of a hidden state x (B, T, H) entering its final norm, on the draft vocabulary."""
    return hf.lm_head(hf.model.norm(x))[..., DRAFT_VOCAB]


def test_target_init_reads_the_target_logit_lens_of_the_high_feature():
    head, hf = _head("target"), _hf()
    assert head.init_report == list(INIT_PARTS)
    x = torch.randn(2, 5, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(head.logits(x), _target_logit_lens(hf, x))
    # fc passes the high feature through: at step 0 the fused feature is the target's own hidden state entering
    # its highest feature layer (here the last layer, 3), so lm_head(norm(fuse(f))) is the target's logit lens
    target = _target()
    out = target.prefill(torch.tensor([[4, 90, 17, 3, 66, 21, 8]]), target.new_cache())
    h = hf.config.hidden_size
    fused = head.fuse(out.features)
    torch.testing.assert_close(fused, out.features[..., 2 * h:])
    torch.testing.assert_close(head.logits(fused), _target_logit_lens(hf, out.features[..., 2 * h:]))
    # the MLP and its norms are the last layer's
    last = hf.model.layers[-1]
    torch.testing.assert_close(head.midlayer.mlp(x), last.mlp(x))
    torch.testing.assert_close(head.midlayer.post_attention_layernorm(x), last.post_attention_layernorm(x))
    torch.testing.assert_close(head.midlayer.hidden_norm(x), last.input_layernorm(x))


def test_random_init_is_the_default_and_unchanged():
    default, explicit = _head_default(), _head("random")
    for k, v in default.state_dict().items():
        assert torch.equal(v, explicit.state_dict()[k]), k
    assert default.init_report == []
    # negative control: the random head does not read the target's logit lens
    x = torch.randn(2, 5, _hf().config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(default.logits(x), _target_logit_lens(_hf(), x), atol=1e-3)


def _head_default() -> Eagle3DraftModel:
    return Eagle3DraftModel.from_target(_target(), draft_vocab=DRAFT_VOCAB)


def test_parts_are_chosen_one_by_one():
    head, rand = _head("target", init_parts=["lm_head"]), _head("random")
    assert head.init_report == ["lm_head"]
    torch.testing.assert_close(head.lm_head.weight, _hf().lm_head.weight[DRAFT_VOCAB])
    for name in ("fc.weight", "norm.weight", "midlayer.mlp.up_proj.weight"):  # untouched: the random ones
        assert torch.equal(head.state_dict()[name], rand.state_dict()[name]), name


def test_bad_init_settings_are_refused():
    with pytest.raises(ValueError, match="unknown initialisation part"):
        check_init_parts(["lm_head", "attention"])
    with pytest.raises(ValueError, match="repeat"):
        check_init_parts(["fc", "fc"])
    with pytest.raises(ValueError, match="'random' or 'target'"):
        _head("copy")
