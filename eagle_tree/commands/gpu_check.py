"""The prepared device check: exactness, the round split and a head training step, in one command.

``bash scripts/gpu_check.sh [--out DIR]`` runs ``python -m eagle_tree.commands.gpu_check`` (docs/MEASURING.md,
"The device check"). It is written for a GPU lent for a few minutes with nothing but an image of
torch, transformers, accelerate, safetensors, tokenizers, numpy and pytest, so it imports nothing
else (no W&B, datasets, matplotlib or scipy), and it rehearses on CPU (``--device cpu --small``, tiny
models, under a minute) in the test suite, so that it cannot rot in between. Sections:

1. ``exactness``: on the reference target (float32, and bfloat16 with probabilities in float32),
   greedy chain, tree, context branches, the head's default decoder and a batch of 4 against plain
   greedy decoding; and the law of the first tokens at T = 1 on the tiny target of the sampling suite
   (eagle_tree/bench/law.py) with fewer runs than the suite.
2. ``round_split``: eagle_tree/bench/round_split.py on the reference target with its shipped head, and
   on randomly initialised targets of SmolLM2-135M's and Llama-3.1-8B's shapes in bfloat16, each with a
   head from ``Eagle3DraftModel.from_target``.
3. ``training``: head training steps (online target features, the training-time test, AdamW) on the
   8B-shaped target under bfloat16 autocast with float32 master weights: tokens per second and peak
   memory.

Each section runs on its own: an error is recorded in the section (and makes the check fail) and the
next section still runs; ``DIR/gpu_check.json`` is rewritten after every section, so a run cut short
keeps what it measured. Sections that would start after ``--budget-s`` are skipped and say so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
import traceback
from pathlib import Path

import torch

from eagle_tree.bench import law
from eagle_tree.bench.memory import PeakMemory
from eagle_tree.bench.round_split import GREEDY, n_bytes, random_head, random_target, round_split
from eagle_tree.bench.timing import synchronize
from eagle_tree.core.sampling import SamplingConfig, processed_probs
from eagle_tree.core.tree import Tree
from eagle_tree.decoding.context import ContextConfig
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel
from eagle_tree.utils.atomic import write_text

FORMAT = "eagle-tree/gpu-check/v1"
ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "assets" / "reference"
SECTIONS = ("exactness", "round_split", "training")
EXACT_SHAPES = {
    "chain-4": TreeConfig.chain(4),
    "tree-d6k8n48": TreeConfig(depth=6, top_k=8, total_tokens=48),
    "context-chain-4+ctx8": TreeConfig(depth=4, top_k=1, total_tokens=4, context=ContextConfig(lookup_tokens=8)),
    "head-default": None,  # the shipped head's decoding.json (context branches included)
}
BATCH = 4
# bfloat16: a speculative output may leave plain greedy decoding's only where the two tokens' logits,
# from a cache-free forward of the common prefix, are this close relative to the larger one (the
# verify forward of k rows and the one-row step round differently; 8 bfloat16 ulps)
BF16_TIE = 2.0**-5
LAW_CASES = {  # from the sampling suite (tests/test_decoder_exactness.py, SETTINGS)
    "head-tree-sampled-T1-reduced-vocab": (SamplingConfig(temperature=1.0), True,
                                           TreeConfig(depth=2, top_k=3, total_tokens=12, sampled=True), True),
    "head-tree-deterministic-T1-topk": (SamplingConfig(temperature=1.0, top_k=6), False,
                                        TreeConfig(depth=2, top_k=3, total_tokens=8), False),
    "head-chain-sampled-T1-topp": (SamplingConfig(temperature=1.0, top_p=0.8), False,
                                   TreeConfig.chain(length=2, sampled=True), False),
}
LAW_REDUCED_VOCAB = [0, 1, 2, 4, 5, 6, 8, 9, 11, 12, 13, 15]


# sizes of a full (GPU) run and of the CPU rehearsal (--small)
SIZES = {
    False: dict(prompts=4, prompt_tokens=256, new_tokens=64, law_runs=500, reps=10, split_prompts=2,
                split_context=512, targets=("smollm2-135m-shape", "llama-3.1-8b-shape"), train_batch=2,
                train_tokens=2048, train_steps=3, ttt_steps=7),
    True: dict(prompts=4, prompt_tokens=32, new_tokens=12, law_runs=100, reps=2, split_prompts=1,
               split_context=32, targets=("smollm2-135m-shape-small", "llama-3.1-8b-shape-small"), train_batch=2,
               train_tokens=64, train_steps=2, ttt_steps=3),
}


# ----------------------------------------------------------------------------- exactness


def reference_models(dtype: torch.dtype, device: torch.device) -> tuple[TargetModel, Eagle3DraftModel]:
    target = TargetModel.from_pretrained(str(REFERENCE / "target"), dtype=dtype)
    target.model.to(device)
    head = Eagle3DraftModel.from_pretrained(REFERENCE / "head", target=target, dtype=dtype).to(device)
    return target, head


def reference_prompts(n: int, tokens: int) -> list[torch.Tensor]:
    """The first ``n`` test prompts of the reference target, their last ``tokens`` tokens, (1, T) each."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(REFERENCE / "target"))
    with open(REFERENCE / "prompts" / "test.jsonl") as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()][:n]
    return [tokenizer(t, return_tensors="pt").input_ids[:, -tokens:] for t in texts]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a shorter one differs where it ends), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def tie_gap(target: TargetModel, prefix: list[int], a: int, b: int) -> float:
    """|z_a - z_b| / max(|z_a|, |z_b|, 1) of the target's logits after ``prefix``, from one cache-free forward."""
    z = target.model(torch.tensor([prefix], device=target.device), use_cache=False).logits[0, -1].float()
    za, zb = float(z[a]), float(z[b])
    return abs(za - zb) / max(abs(za), abs(zb), 1.0)


def compare(target: TargetModel, prompt: torch.Tensor, got: list[int], want: list[int], tie: float | None) -> dict:
    """One speculative output against plain decoding's: equal, or (with ``tie``) different only from a
    near-tie of the two tokens on."""
    i = first_difference(got, want)
    row = {"equal": i is None}
    if i is not None:
        row["first_difference"] = i
        if tie is not None and i < min(len(got), len(want)):
            gap = tie_gap(target, prompt[0].tolist() + want[:i], want[i], got[i])
            row["tie_gap"] = gap
            row["near_tie"] = gap <= tie
    row["ok"] = row["equal"] or bool(row.get("near_tie"))
    return row


def reference_exactness(dtype: torch.dtype, device: torch.device, size: dict) -> dict:
    """Greedy chain, tree, context branches, the head's defaults and a batch of 4 against plain greedy
    decoding on the reference target in ``dtype``."""
    target, head = reference_models(dtype, device)
    prompts = reference_prompts(size["prompts"], size["prompt_tokens"])
    n, tie = size["new_tokens"], (None if dtype == torch.float32 else BF16_TIE)

    def new(seq, prompt):
        return seq.reshape(-1)[prompt.shape[1]:].tolist()

    plain = [new(SpeculativeDecoder(target).generate(p, n, sampling=GREEDY).sequences, p) for p in prompts]
    cases = {}
    for name, tree in EXACT_SHAPES.items():
        dec = SpeculativeDecoder(target, head, tree=tree)
        rows, committed, rounds = [], 0, 0
        for p, want in zip(prompts, plain, strict=True):
            out = dec.generate(p, n, sampling=GREEDY)
            rows.append(compare(target, p, new(out.sequences, p), want, tie))
            committed, rounds = committed + sum(out.acceptance_lengths), rounds + len(out.rounds)
        cases[name] = {"ok": all(r["ok"] for r in rows), "equal": sum(r["equal"] for r in rows), "calls": len(rows),
                       "tokens_per_round": committed / max(rounds, 1),
                       "differences": [r for r in rows if not r["equal"]]}
    batch = SpeculativeDecoder(target, head, tree=EXACT_SHAPES["tree-d6k8n48"])
    out = batch.generate_batch([p[0] for p in prompts[:BATCH]], n, sampling=GREEDY)
    rows = [compare(target, p, new(seq, p), want, tie)
            for p, seq, want in zip(prompts[:BATCH], out.sequences, plain, strict=False)]
    committed = sum(map(sum, out.acceptance_lengths))
    cases[f"batch-{BATCH}-tree-d6k8n48"] = {
        "ok": all(r["ok"] for r in rows) and len(rows) == min(BATCH, len(prompts)),
        "equal": sum(r["equal"] for r in rows), "calls": len(rows),
        "tokens_per_round": committed / max(sum(len(a) for a in out.acceptance_lengths), 1),
        "differences": [r for r in rows if not r["equal"]]}
    # the verifier's probabilities are float32 whatever the target's dtype
    cache = target.new_cache(prompts[0].shape[1] + 4)
    logits = target.prefill(prompts[0].to(device), cache).logits
    verify_logits = target.verify([int(prompts[0][0, -1])], [Tree([-1, 0], [5, 6])], cache).logits
    probs = processed_probs(verify_logits[0], SamplingConfig(temperature=1.0))
    float32 = logits.dtype == verify_logits.dtype == probs.dtype == torch.float32
    accepted = any(c["tokens_per_round"] > 1.0 for c in cases.values())  # multi-token acceptance happened
    return {"dtype": str(dtype).removeprefix("torch."), "new_tokens": n, "prompts": len(prompts),
            "tie_tolerance": tie, "probabilities_float32": float32, "accepted_drafts": accepted, "cases": cases,
            "ok": float32 and accepted and all(c["ok"] for c in cases.values())}


def law_check(device: torch.device, runs: int) -> dict:
    """The T = 1 law of the first tokens on the tiny target (chi-square against the exact law)."""
    target = law.law_target()
    target.model.to(device)
    heads = {reduced: Eagle3DraftModel.from_target(target, draft_vocab=LAW_REDUCED_VOCAB if reduced else None,
                                                   seed=1).to(device) for reduced in (False, True)}
    cases = {}
    for name, (sampling, reduced, tree, depth2) in LAW_CASES.items():
        c12, c23, accepted = law.draw_counts(SpeculativeDecoder(target, heads[reduced], tree=tree), sampling, runs,
                                             depth2)
        joint12, joint23 = law.exact_laws(target, sampling)
        p12 = law.chi2_pvalue(c12, joint12)
        p23 = law.chi2_pvalue(c23, joint23) if depth2 else None
        some_accepted = 0 < sum(a > 0 for a in accepted) < runs  # drafts both accepted and rejected
        cases[name] = {"p_x1_x2": p12, "p_x2_x3": p23, "accepted_fraction": sum(a > 0 for a in accepted) / runs,
                       "ok": p12 > law.LAW_ALPHA and (p23 is None or p23 > law.LAW_ALPHA) and some_accepted}
    return {"runs": runs, "alpha": law.LAW_ALPHA, "cases": cases, "ok": all(c["ok"] for c in cases.values())}


def exactness(device: torch.device, size: dict) -> dict:
    result = {"reference_float32": reference_exactness(torch.float32, device, size),
              "reference_bfloat16": reference_exactness(torch.bfloat16, device, size),
              "law_t1": law_check(device, size["law_runs"])}
    result["ok"] = all(r["ok"] for r in result.values())
    return result


# ----------------------------------------------------------------------------- round split and training


def random_prompts(vocab: int, n: int, tokens: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, tokens), generator=g) for _ in range(n)]


def split_targets(device: torch.device, size: dict):
    """(name, target, head, prompts) of each target of the round split, built one at a time."""
    target, head = reference_models(torch.float32, device)
    yield "reference", target, head, reference_prompts(size["split_prompts"], size["prompt_tokens"])
    del target, head
    for shape in size["targets"]:
        target = random_target(shape, torch.bfloat16, device)
        yield shape, target, random_head(target), random_prompts(target.vocab_size, size["split_prompts"],
                                                                 size["split_context"])
        del target
        free(device)


def free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def round_splits(device: torch.device, size: dict) -> dict:
    result = {}
    for name, target, head, prompts in split_targets(device, size):
        result[name] = round_split(target, head, prompts, size["new_tokens"], size["reps"])
        del target, head
    result["ok"] = True
    return result


def training(device: torch.device, size: dict) -> dict:
    """Head training steps on the 8B-shaped target: bfloat16 target, online features and logits (one
    causal forward per example, as training does), the training-time test under bfloat16 autocast with
    float32 master weights, backward, clipping, AdamW."""
    from eagle_tree.training.feature_cache import example_targets
    from eagle_tree.training.stream import pad_targets
    from eagle_tree.training.ttt import ttt_forward
    from eagle_tree.utils.optim import adamw

    shape = size["targets"][-1]
    target = random_target(shape, torch.bfloat16, device)
    head = random_head(target).float().train()
    optimizer = adamw(head, lr=1e-4)
    b, t, steps = size["train_batch"], size["train_tokens"], size["ttt_steps"]
    ids = random_prompts(target.vocab_size, b, t, seed=1)
    input_ids = torch.cat(ids).to(device)
    loss_mask = torch.ones_like(input_ids)

    def step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        features, logits = pad_targets([example_targets(target, row) for row in input_ids], t)
        synchronize(device)
        t1 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = ttt_forward(head, features.float(), input_ids, loss_mask, logits, steps, 0.8)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        return time.perf_counter() - t0, t1 - t0, float(out.loss.detach())

    step()  # warm-up: allocator, kernels, the optimiser's state
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with PeakMemory(device) as mem:
        timed = [step() for _ in range(size["train_steps"])]
    step_s = sum(s for s, _, _ in timed) / len(timed)
    target_s = sum(f for _, f, _ in timed) / len(timed)
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    result = {
        "target": shape, "target_weights_mb": n_bytes(target.model) / 2**20, "head_trainable_parameters": trainable,
        "draft_vocab_size": head.config.draft_vocab_size, "batch": b, "tokens_per_example": t, "ttt_steps": steps,
        "precision": "bf16 autocast, float32 master weights and AdamW state, bfloat16 target",
        "steps_timed": len(timed), "step_s": step_s, "target_features_s": target_s,
        "tokens_per_s": b * t / step_s, "head_tokens_per_s": b * t / max(step_s - target_s, 1e-9),
        "losses": [loss for _, _, loss in timed], "peak_mb": mem.peak_bytes / 2**20,
    }
    if device.type == "cuda":
        result["peak_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    result["ok"] = all(math.isfinite(x) for x in result["losses"])
    return result


# ----------------------------------------------------------------------------- the run and its report


def conditions(device: torch.device, small: bool) -> dict:
    import transformers

    info = {"device": str(device), "small": small, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "memory_method": PeakMemory(device).method}
    try:
        import accelerate

        info["accelerate"] = accelerate.__version__
    except ImportError:
        info["accelerate"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["gpu_memory_mb"] = torch.cuda.get_device_properties(device).total_memory / 2**20
    return info


def run_check(out_dir: Path, device: torch.device, small: bool, budget_s: float, only=SECTIONS) -> dict:
    """Run the sections in order, rewriting ``out_dir/gpu_check.json`` (and the markdown) after each."""
    size = SIZES[small]
    report = {"format": FORMAT, "conditions": conditions(device, small), "sizes": dict(size), "sections": {}}
    start, cpu_start = time.perf_counter(), time.process_time()
    runners = {"exactness": exactness, "round_split": round_splits, "training": training}
    for name in SECTIONS:
        if name not in only:
            continue
        elapsed = time.perf_counter() - start
        if elapsed > budget_s:
            report["sections"][name] = {"ok": False, "skipped": f"the budget of {budget_s:.0f} s was spent"}
        else:
            t0 = time.perf_counter()
            try:
                report["sections"][name] = runners[name](device, size)
            except Exception as exc:  # recorded, and the next section still runs
                report["sections"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                            "traceback": traceback.format_exc().splitlines()[-12:]}
            report["sections"][name]["wall_s"] = time.perf_counter() - t0
            free(device)
        report["wall_s"] = time.perf_counter() - start
        report["cpu_s"] = time.process_time() - cpu_start  # this process's CPU time (all threads)
        report["ok"] = all(s["ok"] for s in report["sections"].values())
        write_report(out_dir, report)
    return report


def write_report(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "gpu_check.json", json.dumps(report, indent=1, default=str) + "\n")
    write_text(out_dir / "gpu_check.md", markdown(report))


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown(report: dict) -> str:
    c = report["conditions"]
    lines = [f"# Device check ({c['device']}{', ' + c['gpu'] if 'gpu' in c else ''}{', small' if c['small'] else ''})",
             "", f"torch {c['torch']}, transformers {c['transformers']}, accelerate {c.get('accelerate')}, "
             f"Python {c['python']}, {c['date']}; wall {_f(report.get('wall_s'), 1)} s; "
             f"**{'all checks passed' if report.get('ok') else 'FAILED'}**", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {'ok' if sec['ok'] else 'FAILED'} ({_f(sec.get('wall_s'), 1)} s)", ""]
        if "error" in sec or "skipped" in sec:
            lines += [f"`{sec.get('error') or sec.get('skipped')}`", ""]
            continue
        lines += {"exactness": _md_exactness, "round_split": _md_split, "training": _md_training}[name](sec) + [""]
    return "\n".join(lines)


def _md_exactness(sec: dict) -> list[str]:
    lines = ["| target | case | ok | equal / calls | tokens per round | differences |", "|---|---|---|---|---|---|"]
    for key in ("reference_float32", "reference_bfloat16"):
        r = sec[key]
        for name, case in r["cases"].items():
            diffs = "; ".join(f"at {d.get('first_difference')} (gap {_f(d.get('tie_gap'), 4)})"
                              for d in case["differences"]) or "-"
            lines.append(f"| reference {r['dtype']} | {name} | {case['ok']} | {case['equal']} / {case['calls']} | "
                         f"{_f(case['tokens_per_round'])} | {diffs} |")
        lines.append(f"| reference {r['dtype']} | probabilities float32 | {r['probabilities_float32']} | | | |")
    law_sec = sec["law_t1"]
    lines += ["", f"Law of the first tokens at T = 1, tiny target, {law_sec['runs']} runs per case, fail below "
              f"p = {law_sec['alpha']:g}:", "", "| case | ok | p (x1, x2) | p (x2, x3) | round 1 accepted |",
              "|---|---|---|---|---|"]
    for name, case in law_sec["cases"].items():
        lines.append(f"| {name} | {case['ok']} | {_f(case['p_x1_x2'], 4)} | {_f(case['p_x2_x3'], 4)} | "
                     f"{_f(case['accepted_fraction'])} |")
    return lines


def _md_split(sec: dict) -> list[str]:
    lines = []
    for name, r in sec.items():
        if not isinstance(r, dict):
            continue
        t = r["target"]
        lines += [f"### {name}: {t['layers']} layers, hidden {t['hidden_size']}, vocabulary {t['vocab_size']}, "
                  f"{t['dtype']}, {_f(t['weights_mb'], 0)} MB; head draft vocabulary {r['head']['draft_vocab_size']}",
                  "", f"Context {r['context_tokens']} tokens. One target step {_f(r['step_ms'], 3)} ms; one head "
                  f"forward {_f(r['head_forward_ms'], 3)} ms ({_f(r['head_forward_x_step'])} steps).", "",
                  "| k tokens verified | " + " | ".join(str(v["k"]) for v in r["verify"]) + " |",
                  "|---|" + "---|" * len(r["verify"]),
                  "| ms | " + " | ".join(_f(v["ms"], 3) for v in r["verify"]) + " |",
                  "| x one step | " + " | ".join(_f(v["x_step"]) for v in r["verify"]) + " |", "",
                  "| method | tokens / round | draft ms | verify ms | other ms | other share | ms / token | peak MB |",
                  "|---|---|---|---|---|---|---|---|"]
        for m, row in r["methods"].items():
            lines.append(f"| {m} | {_f(row['tokens_per_round'])} | {_f(row['draft_ms'], 3)} | "
                         f"{_f(row['verify_ms'], 3)} | {_f(row['other_ms'], 3)} | {_f(100 * row['other_share'], 1)}% | "
                         f"{_f(row['ms_per_token'], 3)} | {_f(row['peak_mb'], 1)} |")
        hf = r["hf_generate"]
        lines += [f"| Hugging Face generate | 1 | | | | | {_f(hf['ms_per_token'], 3)} | {_f(hf['peak_mb'], 1)} |", "",
                  "Plain decoding in eagle-tree's loop / Hugging Face generate: "
                  f"{_f(hf['plain_loop_over_generate'], 3)} ({r['prompts']} prompt(s), {r['new_tokens']} new tokens).",
                  ""]
    return lines


def _md_training(sec: dict) -> list[str]:
    lines = [f"Target {sec['target']} ({_f(sec['target_weights_mb'], 0)} MB), head "
             f"{sec['head_trainable_parameters']:,} trainable parameters, draft vocabulary {sec['draft_vocab_size']}; "
             f"batch {sec['batch']} x {sec['tokens_per_example']} tokens, {sec['ttt_steps']} training-time-test steps; "
             f"{sec['precision']}.", "",
             "| step s | of which target features s | tokens / s | head tokens / s | peak MB above start | "
             "peak allocated MB |", "|---|---|---|---|---|---|",
             f"| {_f(sec['step_s'], 3)} | {_f(sec['target_features_s'], 3)} | {_f(sec['tokens_per_s'], 0)} | "
             f"{_f(sec['head_tokens_per_s'], 0)} | {_f(sec['peak_mb'], 0)} | {_f(sec.get('peak_allocated_mb'), 0)} |"]
    return lines


def summary(report: dict) -> str:
    """A few lines for the terminal: each section's verdict and headline figures."""
    lines = [f"device check: {'PASSED' if report.get('ok') else 'FAILED'} in {_f(report.get('wall_s'), 1)} s "
             f"on {report['conditions']['device']} {report['conditions'].get('gpu', '')}".rstrip()]
    for name, sec in report["sections"].items():
        text = sec.get("error") or sec.get("skipped") or ""
        if name == "exactness" and not text:
            text = ", ".join(f"{k} {'ok' if v['ok'] else 'FAILED'}" for k, v in sec.items() if isinstance(v, dict))
        elif name == "round_split" and not text:
            text = "; ".join(f"{k}: step {_f(v['step_ms'], 3)} ms, verify 64 x{_f(v['verify'][-1]['x_step'])}, "
                             f"tree round {_f(v['methods']['tree-d6k8n48']['round_ms'], 2)} ms"
                             for k, v in sec.items() if isinstance(v, dict))
        elif name == "training" and not text:
            peak = sec.get("peak_allocated_mb", sec["peak_mb"])
            text = f"{_f(sec['tokens_per_s'], 0)} tokens/s, peak {_f(peak, 0)} MB"
        lines.append(f"  {name}: {'ok' if sec['ok'] else 'FAILED'} ({_f(sec.get('wall_s'), 1)} s) {text}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/gpu-check", help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--device", default=None, help="cuda (the default when available) or cpu")
    p.add_argument("--small", action="store_true", help="tiny models and few runs: the CPU rehearsal")
    p.add_argument("--budget-s", type=float, default=420.0, help="no section starts after this many seconds")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="run these sections only")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    report = run_check(Path(args.out), device, args.small, args.budget_s, tuple(args.only))
    print(summary(report))
    print(f"wrote {Path(args.out) / 'gpu_check.json'} and {Path(args.out) / 'gpu_check.md'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
