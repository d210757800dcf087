"""The outputs of a bench phase as rows: one per method, pooled over repeats and prompts
(docs/MEASURING.md), and the per-shape round measurements the draft-shape tuning reads."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict

import torch

from eagle_tree.bench.runner import HF_GENERATE, PLAIN, Method, PhaseResult
from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.decoding.decoder import GenerateOutput
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.metrics import decode_time_per_token, per_position_acceptance, summarize


def survival_depth(method: Method, outputs: Sequence[GenerateOutput]) -> int:
    """Depth of the survival curve: the tree depth (eagle) or the longest draft verified (hf)."""
    if method.kind == "eagle":
        if method.tree is None:
            return max((r.tree_size for o in outputs for r in o.rounds), default=0) if method.head else 0
        context = method.tree.context
        depth = method.tree.depth if method.head else 0
        return max(depth, context.lookup_tokens if context is not None else 0)
    return max((r.tree_size for o in outputs for r in o.rounds), default=0)


def _tpot(outputs: Sequence[GenerateOutput]) -> float:
    return sum(o.total_s for o in outputs) / max(sum(o.new_tokens for o in outputs), 1)


def method_rows(result: PhaseResult, sampling: SamplingConfig, plain: str = PLAIN.name,
                hf_plain: str = HF_GENERATE.name) -> list[dict]:
    """One dict per method: the DecodeSummary fields (pooled over repeats and prompts) with
    ``time_per_output_token_s`` the median over repeats of each repeat's cumulative time / tokens (and
    ``decode_time_per_token_s`` likewise, after each call's first token),
    plus the speed-ups (medians over repeats of the per-repeat ratio), per-position acceptance,
    peak memory, and, under greedy decoding, whether every output equals plain decoding's."""
    rows = []
    ref = result.outputs.get(plain)
    for method in result.methods:
        runs = result.outputs[method.name]
        flat = [o for rep in runs for o in rep]
        row = summarize(method.name, sampling.temperature, flat, depth=survival_depth(method, flat)).to_dict()
        per_repeat = [_tpot(rep) for rep in runs]
        row["time_per_output_token_s"] = statistics.median(per_repeat)
        row["time_per_output_token_s_repeats"] = per_repeat
        row["decode_time_per_token_s"] = statistics.median(decode_time_per_token(rep) for rep in runs)
        for key, base in (("speedup_vs_plain", plain), ("speedup_vs_hf_generate", hf_plain)):
            base_runs = result.outputs.get(base)
            row[key] = (statistics.median(_tpot(b) / _tpot(m) for b, m in zip(base_runs, runs, strict=True))
                        if base_runs is not None else None)
        row["per_position_acceptance"] = per_position_acceptance(row["survival"])
        row["peak_memory_mb"] = result.peak_bytes[method.name] / 2**20
        row.update(kind=method.kind, shape=method.shape, tree=_tree_dict(method.tree))
        if method.kind == "hf":
            row["time_split_source"] = "forward hooks (verify: target forwards, draft: assistant forwards)"
        mismatched, lengths = [], []
        if ref is not None:
            for r, rep in enumerate(runs):
                for p, out in enumerate(rep):
                    plain_out = ref[r][p]
                    if not torch.equal(out.sequences.cpu(), plain_out.sequences.cpu()):
                        mismatched.append({"repeat": r, "prompt": p})
                    if out.new_tokens != plain_out.new_tokens:
                        lengths.append({"repeat": r, "prompt": p, "tokens": out.new_tokens,
                                        "plain_tokens": plain_out.new_tokens, "stopped_by": out.stopped_by})
        greedy = sampling.greedy and ref is not None
        row["outputs_match_plain"] = (not mismatched) if greedy else None
        row["output_mismatches"] = mismatched if greedy else []
        row["length_differences"] = lengths
        rows.append(row)
    return rows


def _tree_dict(tree: TreeConfig | None) -> dict | None:
    if tree is None:
        return None
    context = None if tree.context is None else asdict(tree.context)
    return {"depth": tree.depth, "top_k": tree.top_k, "total_tokens": tree.total_tokens, "sampled": tree.sampled,
            "context": context}
