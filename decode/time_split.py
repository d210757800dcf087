"""Per-round time split of plain, chain and tree decoding on a tiny target (MEASURING.md).

Usage: python decode/time_split.py [--family llama] [--layers 8] [--hidden 256] [--vocab 512]
       [--prompts 3] [--prompt-length 24] [--new-tokens 48] [--repeats 2] [--chain 4]
       [--depth 4] [--top-k 4] [--total-tokens 16] [--temperature 0.0] [--threads 1] [--seed 0]

Builds a randomly initialised target with eagle_tree.reference.tiny and an untrained EAGLE-3 head
(Eagle3DraftModel.from_target), decodes the same random prompts with each method (interleaved,
after one warm-up call each) and prints, per method: milliseconds per round spent drafting (with
the draft cache catch-up), verifying (the target's tree-masked forward) and in the rest (sampling,
acceptance, cache maintenance); tokens committed per round; time per output token = cumulative wall
time / cumulative new tokens (prefill included, never a mean of per-round ratios); time to first
token. An untrained head is rarely right, so the draft costs time and buys few tokens here: the
point is where a round's time goes. At temperature 0 each method is also checked to give plain
decoding's tokens.
"""

from __future__ import annotations

import argparse
import platform

import torch

from eagle_tree import SamplingConfig
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.metrics import summarize
from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.target import TargetModel
from eagle_tree.reference.tiny import FAMILIES, tiny_causal_lm


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-length", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chain", type=int, default=4, help="draft tokens of the chain")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--total-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[TargetModel, dict[str, SpeculativeDecoder]]:
    heads = max(1, args.hidden // 64)
    model = tiny_causal_lm(args.family, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=heads, num_kv_heads=max(1, heads // 2), intermediate_size=2 * args.hidden,
                           initializer_range=0.1, seed=args.seed)
    target = TargetModel(model)
    head = Eagle3DraftModel.from_target(target, seed=args.seed)
    methods = {
        "plain": SpeculativeDecoder(target),
        f"chain-{args.chain}": SpeculativeDecoder(target, head, tree=TreeConfig.chain(length=args.chain)),
        f"tree-{args.depth}x{args.top_k}/{args.total_tokens}": SpeculativeDecoder(
            target, head, tree=TreeConfig(depth=args.depth, top_k=args.top_k, total_tokens=args.total_tokens)
        ),
    }
    return target, methods


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, methods = build(args)
    sampling = SamplingConfig(temperature=args.temperature)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, args.vocab, (1, args.prompt_length), generator=g) for _ in range(args.prompts)]

    for dec in methods.values():  # warm-up, untimed
        dec.generate(prompts[0], max_new_tokens=4, sampling=sampling)
    outputs: dict[str, list] = {name: [] for name in methods}
    for r in range(args.repeats):  # interleaved: every method sees the same conditions
        for i, prompt in enumerate(prompts):
            for name, dec in methods.items():
                seed = args.seed + 1000 * r + i
                outputs[name].append(dec.generate(prompt, max_new_tokens=args.new_tokens, sampling=sampling, seed=seed))

    print(f"target: {args.family}, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, float32; "
          f"untrained head; torch {torch.__version__}, {torch.get_num_threads()} thread(s), {platform.machine()}")
    print(f"{args.prompts} prompts x {args.repeats} repeats, {args.prompt_length} prompt tokens, "
          f"{args.new_tokens} new tokens, temperature {args.temperature}")
    header = ("method", "rounds", "tok/round", "draft ms", "verify ms", "other ms", "round ms", "TTFT ms", "ms/token")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    depth = max(args.chain, args.depth)
    for name, outs in outputs.items():
        s = summarize(name, args.temperature, outs, depth=depth)
        per_round = s.draft_s_per_round + s.verify_s_per_round + s.other_s_per_round
        cells = (name, str(s.rounds), f"{s.acceptance_length:.2f}", f"{1e3 * s.draft_s_per_round:.2f}",
                 f"{1e3 * s.verify_s_per_round:.2f}", f"{1e3 * s.other_s_per_round:.2f}", f"{1e3 * per_round:.2f}",
                 f"{1e3 * s.time_to_first_token_s:.2f}", f"{1e3 * s.time_per_output_token_s:.2f}")
        print("| " + " | ".join(cells) + " |")
    if args.temperature == 0.0:
        plain = [o.sequences for o in outputs["plain"]]
        same = all(
            torch.equal(a.sequences, b) for outs in outputs.values() for a, b in zip(outs, plain, strict=True)
        )
        print(f"greedy outputs identical to plain decoding: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
