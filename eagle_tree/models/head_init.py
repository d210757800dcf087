"""Initialisation of an EAGLE-3 head from its target's own weights, where the shapes allow.

A fresh head predicts the token after next from the target's features; the target already holds a
good starting point for most of the head:

- ``lm_head``: the target's output rows of the draft vocabulary (draft id ``i`` -> target id
  ``i + d2t[i]``), so the head starts with the target's own token directions;
- ``norm``: the target's final norm (the norm the target's ``lm_head`` was trained behind);
- ``mlp``: the MLP of the target's last layer, with that layer's ``post_attention_layernorm`` before
  it and its ``input_layernorm`` as the head's ``hidden_norm`` (the feature's norm); the embedding's
  norm (``input_layernorm``) is the target's first layer's, the one that sees raw embeddings;
- ``fc``: a pass-through of the high feature (identity on the last ``H`` input columns, zeros
  elsewhere), so the fused feature starts as the target's own hidden state at the highest feature
  layer and the head's ``lm_head(norm(.))`` of it is the target's logit lens at that layer.

The attention projections read ``2H`` inputs where the target's read ``H``; they keep their random
initialisation. A part whose shapes differ from the target's (a head narrower than the target, a
target without a final norm) is skipped and left out of the returned list.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["INIT_PARTS", "check_init_parts", "init_from_target"]

INIT_PARTS = ("lm_head", "norm", "mlp", "fc")


def check_init_parts(parts: Sequence[str]) -> tuple[str, ...]:
    """The parts as a tuple, refused when one is unknown or repeated."""
    parts = tuple(parts)
    unknown = [p for p in parts if p not in INIT_PARTS]
    if unknown:
        raise ValueError(f"unknown initialisation part(s) {unknown}: choose among {list(INIT_PARTS)}")
    if len(set(parts)) != len(parts):
        raise ValueError(f"initialisation parts {list(parts)} repeat a part; name each once")
    return parts


def _copy(dst: nn.Module, src: nn.Module | None) -> bool:
    """Copy every parameter of ``src`` into ``dst`` when both hold the same names and shapes."""
    if src is None:
        return False
    theirs = dict(src.named_parameters())
    ours = dict(dst.named_parameters())
    if set(theirs) != set(ours) or any(theirs[k].shape != ours[k].shape for k in ours):
        return False
    with torch.no_grad():
        for k, p in ours.items():
            p.copy_(theirs[k].detach().to(p.dtype))
    return True


def init_from_target(head, hf_model, parts: Sequence[str] = INIT_PARTS) -> list[str]:
    """Copy the named ``parts`` of ``hf_model`` (a Hugging Face causal LM) into ``head`` (an
    Eagle3DraftModel, not yet trained) where shapes match; return the parts copied."""
    parts = check_init_parts(parts)
    decoder = hf_model.get_decoder()
    layers = decoder.layers
    done: list[str] = []
    if "lm_head" in parts:
        out = hf_model.get_output_embeddings()
        if out is not None and out.weight.shape[1] == head.lm_head.weight.shape[1] and \
                getattr(out, "bias", None) is None:
            rows = head.draft_to_target.to(out.weight.device)
            with torch.no_grad():
                head.lm_head.weight.copy_(out.weight.detach()[rows].to(head.lm_head.weight.dtype))
            done.append("lm_head")
    if "norm" in parts and _copy(head.norm, getattr(decoder, "norm", None)):
        done.append("norm")
    if "mlp" in parts:
        last, mid = layers[-1], head.midlayer
        pairs = [(mid.mlp, getattr(last, "mlp", None)),
                 (mid.post_attention_layernorm, getattr(last, "post_attention_layernorm", None)),
                 (mid.hidden_norm, getattr(last, "input_layernorm", None)),
                 (mid.input_layernorm, getattr(layers[0], "input_layernorm", None))]
        if all(_copy(dst, src) for dst, src in pairs[:1]):  # the MLP decides; its norms follow where they match
            for dst, src in pairs[1:]:
                _copy(dst, src)
            done.append("mlp")
    if "fc" in parts:
        w = head.fc.weight  # (H, 3 H_target)
        h, th = w.shape[0], w.shape[1] // 3
        if h == th:
            with torch.no_grad():
                w.zero_()
                w[:, 2 * th:].copy_(torch.eye(h, dtype=w.dtype, device=w.device))
            done.append("fc")
    return done
