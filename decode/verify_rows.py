"""What a verification of n tokens costs on one target, against a one-token step (docs/MEASURING.md,
"Linear kernels on CPU").

    python decode/verify_rows.py --target $(eagle-tree reference smollm2 | tail -1) --threads 2
    python decode/verify_rows.py --sizes 1 2 3 4 5 8 16 --past 400 --repeats 9

Three forwards of n new tokens on a cache of ``--past`` tokens, interleaved (the one timing harness):
``TargetModel.verify`` of a chain of n - 1 nodes with ``F.linear`` weights, the same on a copy of the
target with packed weights (``prepack=True``: the packed copy serves every row count, the one-token
step included), and the Hugging Face model's own forward on a ``DynamicCache``. Each call's new entries
are dropped again, so every call sees the same cache. Prints per n the median ms, the multiple of the
``F.linear`` one-token step and of the packed one, and whether the packed copy's greedy tokens equal the
unpacked ones.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from eagle_tree.bench.timing import interleave
from eagle_tree.core.tree import Tree
from eagle_tree.models.target import TargetModel


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="assets/reference/target")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16])
    p.add_argument("--past", type=int, default=400, help="tokens in the cache before each call")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if min(args.sizes) < 1 or 1 not in args.sizes:
        p.error("--sizes must be positive and include 1 (the step every other size is a multiple of)")
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    targets = {"F.linear": TargetModel.from_pretrained(args.target),
               "packed": TargetModel.from_pretrained(args.target, prepack=True)}
    vocab = targets["F.linear"].vocab_size
    prompt = torch.randint(0, vocab, (1, args.past), generator=g)
    tokens = {n: torch.randint(0, vocab, (n,), generator=g).tolist() for n in args.sizes}
    caches = {}
    for name, target in targets.items():
        caches[name] = target.new_cache(capacity=args.past + max(args.sizes) + 8)
        target.prefill(prompt, caches[name])
    hf_model, hf_cache = targets["F.linear"].model, DynamicCache()
    with torch.no_grad():
        hf_model(input_ids=prompt, past_key_values=hf_cache, use_cache=True)

    def ours(name: str, n: int):
        target, cache = targets[name], caches[name]

        def call(_block: int) -> torch.Tensor:
            out = target.verify([tokens[n][0]], [Tree.chain(tokens[n][1:])], cache)
            cache.compact([args.past], [[]])  # drop the n new entries again
            return out.logits[0].argmax(-1)
        return call

    def hf(n: int):
        ids = torch.tensor([tokens[n]])

        def call(_block: int) -> None:
            with torch.no_grad():
                hf_model(input_ids=ids, past_key_values=hf_cache, use_cache=True)
            hf_cache.crop(-n)
        return call

    methods = {}
    for n in args.sizes:
        methods[f"F.linear/{n}"] = ours("F.linear", n)
        methods[f"packed/{n}"] = ours("packed", n)
        methods[f"hf/{n}"] = hf(n)
    runs = interleave(methods, args.repeats, warmup=[0])
    ms = {name: 1e3 * statistics.median(t.seconds for t in calls) for name, calls in runs.items()}
    print(f"target {args.target}; cache of {args.past} tokens; {torch.get_num_threads()} thread(s); "
          f"medians of {args.repeats}, interleaved")
    print("| new tokens | verify, F.linear ms | x step | verify, packed ms | x F.linear step | x packed step | "
          "HF forward ms | x step | packed greedy = F.linear |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        a, b, h = ms[f"F.linear/{n}"], ms[f"packed/{n}"], ms[f"hf/{n}"]
        same = all(torch.equal(x.value, y.value) for x, y in zip(runs[f"F.linear/{n}"], runs[f"packed/{n}"],
                                                                 strict=True))
        print(f"| {n} | {a:.1f} | {a / ms['F.linear/1']:.2f} | {b:.1f} | {b / ms['F.linear/1']:.2f} | "
              f"{b / ms['packed/1']:.2f} | {h:.1f} | {h / ms['hf/1']:.2f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
