"""Per-round time split of plain, chain and tree decoding on the shipped reference target (docs/MEASURING.md).

Usage: python decode/time_split.py [--target assets/reference/target] [--head assets/reference/head]
       [--prompts assets/reference/prompts/test.jsonl] [--limit 4] [--new-tokens 64] [--repeats 2]
       [--shapes plain chain-2 tree-d3k3n8] [--temperature 0.0] [--threads 2] [--compile] [--seed 0]
       [--prepack off|on|rows|both|one-row] [--head-int8 off|on|both] [--head-prepack off|on|both]

Decodes the same prompts with each shape and with Hugging Face ``generate`` (interleaved, after one
warm-up call each) and prints one row per shape, side by side:

- draft ms per round and per head forward (a chain of L tokens and a tree of depth d run L and d head
  forwards a round: the catch-up on the committed pairs, then one per level below the first);
- verify ms per round, and as a multiple of one target step (plain decoding's verify ms per round:
  a one-token forward);
- other ms per round (acceptance, cache compaction, bookkeeping) and its share of the round;
- tokens per round, time per output token (cumulative wall time / new tokens, prefill included) and
  the speed-up over plain decoding in eagle-tree's loop;
- for plain decoding, Hugging Face ``generate`` time per token on the same prompts (its own cache,
  greedy or sampled with the same settings, EOS disabled), the honest denominator's check.

``--prepack both`` runs every shape on a second copy of the target whose linear layers hold oneDNN-packed
weights for every forward (eagle_tree.models.prepack; rows named ``SHAPE prepacked``), interleaved
with the first, so the two kernels are compared under the same conditions; speed-ups stay against the
first copy's plain decoding. ``rows`` packs for forwards of several rows only (``prepack_one_row=False``,
rows named ``SHAPE prepacked-rows``), and ``one-row`` compares that copy (first) with the packed one.
``--head-int8 both`` likewise runs every head shape a second time with an int8 copy of the head's
lm_head (eagle_tree.models.quantize; rows named ``SHAPE int8``), and ``--head-prepack both`` with the
head's other linear layers packed (rows named ``SHAPE head-packed``; the bench's ``target_prepack``
packs both the target and the head).

EOS is ignored so every call produces ``--new-tokens`` tokens. At temperature 0 every shape is also
checked to give plain decoding's tokens. The default run (4 prompts, 64 tokens, 2 repeats) takes about
a minute on 2 quiet CPU cores. ``PYTHONPATH=<another checkout> python decode/time_split.py`` measures
that checkout's decoder with the same script (without ``--compile``), for before/after figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from eagle_tree.bench.timing import interleave
from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.metrics import summarize
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel


def parse_shape(text: str) -> TreeConfig | None:
    """'plain' -> None, else a shape name as ``TreeConfig.name`` spells it (chain-2, tree-d3k3n8, ...)."""
    if text == "plain":
        return None
    try:
        return TreeConfig.from_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="assets/reference/target")
    p.add_argument("--head", default="assets/reference/head")
    p.add_argument("--prompts", default="assets/reference/prompts/test.jsonl", help="jsonl with a 'prompt' field")
    p.add_argument("--limit", type=int, default=4, help="prompts used")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--shapes", nargs="+", default=["plain", "chain-2", "tree-d3k3n8"])
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="SpeculativeDecoder(compile=True)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prepack", choices=["off", "on", "rows", "both", "one-row"], default="off",
                   help="the target's linear layers with packed weights (eagle_tree.models.prepack): on = every "
                        "forward, rows = several rows only, both = off and on, one-row = rows and on")
    p.add_argument("--head-int8", choices=["off", "on", "both"], default="off",
                   help="the head's lm_head with an int8 copy (eagle_tree.models.quantize)")
    p.add_argument("--head-prepack", choices=["off", "on", "both"], default="off",
                   help="the head's float32 linear layers with packed weights (after --head-int8)")
    return p.parse_args(argv)


def hf_generate_s(model, prompt: torch.Tensor, new_tokens: int, sampling: SamplingConfig, seed: int) -> float:
    """Seconds of one Hugging Face ``generate`` call producing exactly ``new_tokens`` tokens."""
    kwargs = dict(max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)  # no EOS: exactly new_tokens
    if sampling.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return elapsed


def head_forwards(tree: TreeConfig | None) -> int:
    """Head forwards a round: the catch-up, then one per level below the first."""
    return 0 if tree is None else tree.depth


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    shapes = {name: parse_shape(name) for name in args.shapes}
    if "plain" not in shapes:
        shapes = {"plain": None, **shapes}
    packing = {"": {}, " prepacked": {"prepack": True},  # row-name suffix -> TargetModel.from_pretrained options
               " prepacked-rows": {"prepack": True, "prepack_one_row": False}}
    kernels = {"off": [""], "on": [" prepacked"], "rows": [" prepacked-rows"], "both": ["", " prepacked"],
               "one-row": [" prepacked-rows", " prepacked"]}[args.prepack]
    options = {"compile": True} if args.compile else {}  # without it, the script also runs on older checkouts
    decoders, trees = {}, {}
    for suffix in kernels:  # prepack= only when asked, so the script also runs on older checkouts
        target = TargetModel.from_pretrained(args.target, **packing[suffix])
        int8s = {"off": [""], "on": [" int8"], "both": ["", " int8"]}[args.head_int8]
        packs = {"off": [""], "on": [" head-packed"], "both": ["", " head-packed"]}[args.head_prepack]
        variants = [(int8, packed) for int8 in int8s for packed in packs]
        for int8, packed in variants:
            head = Eagle3DraftModel.from_pretrained(args.head, target=target)
            if int8:
                from eagle_tree.models.quantize import quantize_lm_head

                quantize_lm_head(head)
            if packed:
                from eagle_tree.models.prepack import prepack_linears

                prepack_linears(head)
            for name, tree in shapes.items():
                if tree is None and (int8, packed) != variants[0]:
                    continue  # plain decoding has no head: one row of it per target copy
                decoders[name + suffix + int8 + packed] = SpeculativeDecoder(target, None if tree is None else head,
                                                                             tree=tree, **options)
                trees[name + suffix + int8 + packed] = tree
        if suffix == kernels[0]:
            first_target = target
    target = first_target
    plain_name = ("plain" + kernels[0] + (" int8" if args.head_int8 == "on" else "")
                  + (" head-packed" if args.head_prepack == "on" else ""))
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    with open(args.prompts) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()][: args.limit]
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    sampling = SamplingConfig(temperature=args.temperature)

    for dec in decoders.values():  # warm-up, untimed (compilation happens here)
        dec.generate(prompts[0], max_new_tokens=8, sampling=sampling)
    hf_generate_s(target.model, prompts[0], 8, sampling, args.seed)
    n = len(prompts)

    def seed_of(block: int) -> int:  # block = repeat * n + prompt
        return args.seed + 1000 * (block // n) + block % n

    calls = {name: (lambda b, dec=dec: dec.generate(prompts[b % n], max_new_tokens=args.new_tokens,
                                                    sampling=sampling, seed=seed_of(b)))
             for name, dec in decoders.items()}
    calls["hf_generate"] = lambda b: hf_generate_s(target.model, prompts[b % n], args.new_tokens, sampling, seed_of(b))
    runs = interleave(calls, args.repeats * n)  # every method sees the same conditions
    outputs = {name: [t.value for t in runs[name]] for name in decoders}
    hf_s = sum(t.value for t in runs["hf_generate"])
    hf_ms_per_token = 1e3 * hf_s / (args.repeats * n * args.new_tokens)

    print(f"target {args.target}, head {args.head}, float32; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), {platform.machine()}, compile={args.compile}")
    print(f"{len(prompts)} prompts x {args.repeats} repeats, {args.new_tokens} new tokens, temperature "
          f"{args.temperature}")
    header = ("shape", "tok/round", "draft ms", "per head fwd", "verify ms", "x target step", "other ms",
              "other share", "round ms", "ms/token", "speed-up")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    summaries = {name: summarize(name, args.temperature, outs, depth=(trees[name] or TreeConfig.chain(1)).depth)
                 for name, outs in outputs.items()}
    step_ms = 1e3 * summaries[plain_name].verify_s_per_round
    plain_tpot = summaries[plain_name].time_per_output_token_s
    for name, s in summaries.items():
        draft, verify, other = (1e3 * s.draft_s_per_round, 1e3 * s.verify_s_per_round, 1e3 * s.other_s_per_round)
        round_ms = draft + verify + other
        forwards = head_forwards(trees[name])
        cells = (name, f"{s.acceptance_length:.2f}", f"{draft:.2f}",
                 f"{draft / forwards:.2f} ({draft / forwards / step_ms:.2f} step)" if forwards else "-",
                 f"{verify:.2f}", f"{verify / step_ms:.2f}", f"{other:.2f}", f"{100 * other / round_ms:.1f}%",
                 f"{round_ms:.2f}", f"{1e3 * s.time_per_output_token_s:.2f}",
                 f"{plain_tpot / s.time_per_output_token_s:.2f}x")
        print("| " + " | ".join(cells) + " |")
    print(f"plain decoding: eagle-tree loop {1e3 * plain_tpot:.2f} ms/token, Hugging Face generate "
          f"{hf_ms_per_token:.2f} ms/token (loop / generate = {1e3 * plain_tpot / hf_ms_per_token:.3f})")
    if args.temperature == 0.0:
        plain = [o.sequences for o in outputs[plain_name]]
        same = all(torch.equal(a.sequences, b) for outs in outputs.values() for a, b in zip(outs, plain, strict=True))
        print(f"greedy outputs identical to plain decoding: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
