"""Loading a decoder from folders: the target, the head (checked before and after loading) and the
draft shape a decoding mode names. ``eagle-tree decode`` and ``eagle-tree bench`` call it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.utils.checks import InputError, check_finite_weights, check_target_path, reading

if TYPE_CHECKING:
    from eagle_tree.models.prepack import PrepackSetting


def check_head_path(head: str) -> None:
    if not Path(head).is_dir():
        raise InputError(f"head={head}: no such folder; expected an EAGLE-3 head folder (config.json and "
                         "model.safetensors), or mode=plain to decode without one")


def load_decoder(target: str, head: str | None, mode: str, dtype: str, tree: TreeConfig,
                 shapes: str | None = None, prepack: PrepackSetting = False, head_int8: bool = False):
    """(SpeculativeDecoder, tokenizer). ``mode``: "plain" (no head), "tree" / "chain" (``tree``), "auto"
    (the shape a bench tuning file ``shapes`` selected; plain decoding where it selected ``none``) or
    "default" (the head folder's decoding.json, whose entries may be plain decoding too).
    The target path, the head path and the head's weights are checked first. ``prepack``: the target's
    and the head's float32 linear layers get oneDNN-packed weights for every forward; "auto": for the row
    counts where the packed copy times faster at load, the head following the target (eagle_tree.models.prepack).
    ``head_int8``: the head drafts with an int8 copy of its lm_head (eagle_tree.models.quantize)."""
    from eagle_tree.models.gguf import load_tokenizer
    from eagle_tree.models.head import Eagle3DraftModel
    from eagle_tree.models.target import TargetModel

    check_target_path(target)
    if mode != "plain":
        if head is None:
            raise InputError(f"mode={mode} needs a draft head: set head=PATH (or mode=plain)")
        check_head_path(head)
    dtype = getattr(torch, dtype)
    with reading(f"target={target}: its tokenizer cannot be loaded",
                 "the folder needs the tokenizer files (tokenizer.json or tokenizer_config.json) beside the model"):
        tokenizer = load_tokenizer(target)
    draft = None
    if mode != "plain":
        head_path = Path(head)
        layers = None
        if (head_path / "config.json").is_file():
            from eagle_tree.models.layouts import read_config

            with contextlib.suppress(ValueError):  # layers unknown until the target is loaded
                layers = read_config(json.loads((head_path / "config.json").read_text())).feature_layers
        model = TargetModel.from_pretrained(target, dtype=dtype, feature_layers=layers, prepack=prepack)
        draft = Eagle3DraftModel.from_pretrained(head, target=model, dtype=dtype)
        check_finite_weights(draft, f"the head in {head}")
        if head_int8:
            from eagle_tree.models.quantize import quantize_lm_head

            try:
                quantize_lm_head(draft)
            except RuntimeError as exc:
                raise InputError(f"the head in {head}: {exc}") from exc
        choice = model.prepack_choice
        if choice is not None and choice.packs:  # after the int8 copy: an Int8Linear lm_head stays as it is
            from eagle_tree.models.prepack import prepack_linears

            prepack_linears(draft, one_row=choice.one_row, many_rows=choice.many_rows)
    else:
        model = TargetModel.from_pretrained(target, dtype=dtype, prepack=prepack)
    if mode == "auto":
        from eagle_tree.decoding.shapes import load_tuned_shape

        with reading(f"shapes={shapes}", "rerun `eagle-tree bench` to write it, or point shapes= at its file"):
            tree = load_tuned_shape(shapes)
        if tree is None:  # the tuning found no draft shape faster than plain decoding
            return SpeculativeDecoder(model), tokenizer
    if mode == "default":
        defaults = Path(head) / "decoding.json"
        with reading(f"{defaults} (the head's decoding defaults)", "delete it or rewrite it with `eagle-tree bench "
                     "head_defaults=true`"):
            if defaults.is_file() and not isinstance(json.loads(defaults.read_text()), dict):
                raise ValueError("not a JSON object")
            decoder = SpeculativeDecoder(model, draft)  # no tree=: the shapes of the head folder's decoding.json
        if not decoder.defaults:
            raise InputError(f"mode=default: {head} holds no decoding.json; tune one with `eagle-tree bench "
                             "head_defaults=true ...` (docs/BENCHMARKS.md), or use mode=tree / chain / auto")
        return decoder, tokenizer
    return SpeculativeDecoder(model, draft, tree=tree), tokenizer
