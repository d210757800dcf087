"""Evaluation during training: the real acceptance length of the head, measured with SpeculativeDecoder."""

from __future__ import annotations

import copy
from typing import Any

import torch

from eagle_tree.training.config import EvalSection

__all__ = ["evaluate_acceptance"]


@torch.no_grad()
def evaluate_acceptance(target, draft, prompt_ids: list[torch.Tensor], ev: EvalSection,
                        eos_token_id: int | None = None) -> dict:
    """Greedy decoding of every prompt in chain and tree mode: acceptance length (committed tokens per
    round) and the survival curve Pr(A >= i) of accepted draft tokens A, per mode."""
    from eagle_tree.core.sampling import SamplingConfig
    from eagle_tree.decoding.decoder import SpeculativeDecoder
    from eagle_tree.decoding.drafting import TreeConfig
    from eagle_tree.decoding.metrics import summarize

    was_training = draft.training
    head = draft if draft.fc.weight.dtype == target.dtype else copy.deepcopy(draft).to(target.dtype)
    greedy = SamplingConfig(temperature=0.0)
    shapes = {"chain": TreeConfig.chain(ev.chain_length),
              "tree": TreeConfig(depth=ev.tree_depth, top_k=ev.tree_top_k, total_tokens=ev.tree_total_tokens)}
    result: dict[str, Any] = {}
    try:
        for mode, shape in shapes.items():
            decoder = SpeculativeDecoder(target, head, tree=shape)
            outs = [decoder.generate(ids[None], ev.max_new_tokens, greedy, seed=0, eos_token_id=eos_token_id)
                    for ids in prompt_ids]
            summary = summarize(mode, 0.0, outs, depth=shape.depth)
            result[f"acceptance_length_{mode}"] = summary.acceptance_length
            result[f"survival_{mode}"] = summary.survival
            result[f"rounds_{mode}"] = summary.rounds
    finally:
        draft.train(was_training)
    return result

