"""Evaluation during training: the real acceptance length of the head, measured with SpeculativeDecoder,
on the held-out prompts and on the copying prompts, and the head's top-1 agreement with the target per
draft step on the target's own greedy continuations of the held-out prompts."""

from __future__ import annotations

import copy
from typing import Any

import torch

from eagle_tree.training.config import EvalSection
from eagle_tree.training.feature_cache import example_targets
from eagle_tree.training.ttt import ttt_forward

__all__ = ["evaluate_acceptance", "heldout_agreement", "heldout_figures"]


def _eval_head(target, draft):
    return draft if draft.fc.weight.dtype == target.dtype else copy.deepcopy(draft).to(target.dtype)


@torch.no_grad()
def evaluate_acceptance(target, draft, prompt_ids: list[torch.Tensor], ev: EvalSection,
                        eos_token_id: int | None = None, copy_ids: list[torch.Tensor] | None = None,
                        agreement_steps: int = 0) -> dict:
    """Greedy decoding of every prompt in chain and tree mode: acceptance length (committed tokens per
    round) and the survival curve Pr(A >= i) of accepted draft tokens A, per mode; with ``copy_ids``, also
    the chain of ``ev.copy_chain_length`` on the copying prompts (``acceptance_length_copy_chain``); with
    ``agreement_steps``, the head's top-1 agreement per draft step on the greedy continuations the chain
    decoded (the target's own text: ``agreement``, and the tokens counted per step, ``agreement_counts``;
    see :func:`heldout_agreement`), and on the same text the sampled acceptance per draft step
    (``overlap``, ``overlap_counts``; see :func:`heldout_figures`)."""
    from eagle_tree.core.sampling import SamplingConfig
    from eagle_tree.decoding.decoder import SpeculativeDecoder
    from eagle_tree.decoding.drafting import TreeConfig
    from eagle_tree.decoding.metrics import summarize

    was_training = draft.training
    head = _eval_head(target, draft)
    greedy = SamplingConfig(temperature=0.0)
    runs = [("chain", TreeConfig.chain(ev.chain_length), prompt_ids, ev.max_new_tokens),
            ("tree", TreeConfig(depth=ev.tree_depth, top_k=ev.tree_top_k, total_tokens=ev.tree_total_tokens),
             prompt_ids, ev.max_new_tokens)] if prompt_ids else []
    if copy_ids:
        runs.append(("copy_chain", TreeConfig.chain(ev.copy_chain_length), copy_ids, ev.copy_max_new_tokens))
    result: dict[str, Any] = {}
    try:
        for mode, shape, ids_list, budget in runs:
            decoder = SpeculativeDecoder(target, head, tree=shape)
            outs = [decoder.generate(ids[None], budget, greedy, seed=0, eos_token_id=eos_token_id)
                    for ids in ids_list]
            summary = summarize(mode, 0.0, outs, depth=shape.depth)
            if mode == "chain" and agreement_steps:
                result.update(heldout_figures(target, head, [(o.sequences[0], o.prompt_length) for o in outs],
                                              agreement_steps))
            result[f"acceptance_length_{mode}"] = summary.acceptance_length
            result[f"survival_{mode}"] = summary.survival
            result[f"rounds_{mode}"] = summary.rounds
    finally:
        draft.train(was_training)
    return result


@torch.no_grad()
def heldout_figures(target, draft, sequences: list[tuple[torch.Tensor, int]], steps: int) -> dict:
    """Per training-time-test step on ``sequences`` ((token ids (T,), start) pairs; positions >= start
    counted, token-weighted over every sequence): the head's top-1 agreement with the target
    (``agreement``, ``agreement_counts``: as ``train/acc_s``) and its sampled acceptance (``overlap``,
    ``overlap_counts``: the mean of sum_v min(p, q) at temperature 1, the probability that one token
    sampled from the head is accepted there; see ``ttt_forward``). Counts are returned so that the
    figures of several sets pool exactly."""
    was_training = draft.training
    draft.eval()
    sums = {"agreement": [0.0] * steps, "overlap": [0.0] * steps}
    counts = {"agreement": [0] * steps, "overlap": [0] * steps}
    try:
        for ids, start in sequences:
            features, logits = example_targets(target, ids)
            mask = (torch.arange(ids.shape[0], device=features.device) >= start).float()[None]
            out = ttt_forward(draft, features[None].to(draft.fc.weight.dtype), ids[None].to(features.device),
                              mask, logits[None], steps, 1.0, overlap=True)
            for s in range(steps):
                sums["agreement"][s] += out.step_accuracy[s] * out.step_counts[s]
                counts["agreement"][s] += out.step_counts[s]
                sums["overlap"][s] += out.step_overlap[s] * out.overlap_counts[s]
                counts["overlap"][s] += out.overlap_counts[s]
    finally:
        draft.train(was_training)
    result = {}
    for key in ("agreement", "overlap"):
        result[key] = [a / max(n, 1) for a, n in zip(sums[key], counts[key], strict=True)]
        result[f"{key}_counts"] = counts[key]
    return result


@torch.no_grad()
def heldout_agreement(target, draft, sequences: list[tuple[torch.Tensor, int]], steps: int,
                      with_counts: bool = False) -> list[float] | tuple[list[float], list[int]]:
    """Top-1 agreement of the head with the target at each training-time-test step (as ``train/acc_s``) on
    ``sequences``: (token ids (T,), start) pairs, the predicted tokens at positions >= start counted
    (token-weighted over every sequence). ``with_counts``: also the number of tokens counted per step,
    so that agreements on several sets pool exactly."""
    figures = heldout_figures(target, draft, sequences, steps)
    return (figures["agreement"], figures["agreement_counts"]) if with_counts else figures["agreement"]
