"""What packing the query groups saves in a verification forward (docs/MEASURING.md, "Grouped queries").

    python decode/grouped_rows.py --target $(eagle-tree reference smollm2 | tail -1) --threads 2
    python decode/grouped_rows.py --sizes 1 5 7 11 --past 300 700 --repeats 9

Two copies of the target with packed linear weights (``prepack=True``), one with transformers' ``sdpa``
attention (keys and values repeated over each query group on every multi-token forward), one with
``eagle_tree.models.grouped_attention`` (the group packed into query rows). Per cache length
``--past`` and per number of new tokens, ``TargetModel.verify`` of a chain, interleaved (the one timing
harness); each call's new entries are dropped again, so every call sees the same cache. Prints the
median ms of both, their ratio, and whether the logits are bit-identical.
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
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 5, 7, 11])
    p.add_argument("--past", type=int, nargs="+", default=[300, 700], help="tokens in the cache before each call")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if min(args.sizes) < 1 or min(args.past) < 1:
        p.error("--sizes and --past must be positive")
    torch.set_num_threads(args.threads)
    from eagle_tree.models.grouped_attention import GROUPED_SDPA

    targets = {"sdpa": TargetModel.from_pretrained(args.target, prepack=True, attn_implementation="sdpa"),
               "grouped": TargetModel.from_pretrained(args.target, prepack=True, attn_implementation=GROUPED_SDPA)}
    vocab = targets["sdpa"].vocab_size
    g = torch.Generator().manual_seed(0)
    print(f"target {args.target}; packed weights; {torch.get_num_threads()} thread(s); medians of {args.repeats}, "
          "interleaved")
    print("| cache tokens | new tokens | sdpa ms | grouped ms | grouped / sdpa | logits identical |")
    print("|---|---|---|---|---|---|")
    for past in args.past:
        prompt = torch.randint(0, vocab, (1, past), generator=g)
        tokens = {n: torch.randint(0, vocab, (n,), generator=g).tolist() for n in args.sizes}
        caches = {}
        for name, target in targets.items():
            caches[name] = target.new_cache(capacity=past + max(args.sizes) + 8)
            target.prefill(prompt, caches[name])

        def call_of(name: str, n: int, past: int = past, tokens=tokens, caches=caches):
            target, cache = targets[name], caches[name]

            def call(_block: int) -> torch.Tensor:
                out = target.verify([tokens[n][0]], [Tree.chain(tokens[n][1:])], cache)
                cache.compact([past], [[]])  # drop the n new entries again
                return out.logits
            return call

        methods = {f"{name}/{n}": call_of(name, n) for n in args.sizes for name in targets}
        runs = interleave(methods, args.repeats, warmup=[0])
        ms = {name: 1e3 * statistics.median(t.seconds for t in calls) for name, calls in runs.items()}
        for n in args.sizes:
            a, b = ms[f"sdpa/{n}"], ms[f"grouped/{n}"]
            same = all(torch.equal(x.value, y.value) for x, y in zip(runs[f"sdpa/{n}"], runs[f"grouped/{n}"],
                                                                     strict=True))
            print(f"| {past} | {n} | {a:.1f} | {b:.1f} | {b / a:.3f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
