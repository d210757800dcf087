"""A head's lm_head in float32 against its int8 copy (eagle_tree.models.quantize), by number of rows.

Usage: python decode/int8_rows.py [--head assets/smollm2/head] [--rows 1 4 16] [--calls 50] [--repeats 7]
       [--threads 1]

Times ``F.linear`` with the head's float32 ``lm_head`` weight and the ``Int8Linear`` copy the decoder
drafts with under ``head_int8``, on random hidden states of the head's width, the two interleaved
block by block; prints the median ms per call of each over ``--repeats`` blocks of ``--calls`` calls,
their ratio, and how often the two agree on the top token. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from eagle_tree.models.head import Eagle3DraftModel
from eagle_tree.models.quantize import Int8Linear


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", default="assets/smollm2/head")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def _ms_per_call(fn, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return 1e3 * (time.perf_counter() - start) / calls


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    head = Eagle3DraftModel.from_pretrained(args.head).float()
    weight = head.lm_head.weight.detach()
    int8 = Int8Linear(head.lm_head)
    exact = lambda x: F.linear(x, weight)  # noqa: E731
    print(f"{args.head}: lm_head {tuple(weight.shape)} ({weight.numel() * 4 / 1e6:.1f} MB float32), "
          f"{torch.get_num_threads()} thread(s), medians of {args.repeats} x {args.calls} calls")
    print("| rows | float32 ms | int8 ms | float32 / int8 | same top token |")
    print("|---|---|---|---|---|")
    rows = []
    torch.manual_seed(0)
    with torch.no_grad():
        for n in args.rows:
            x = torch.randn(n, weight.shape[1]) * head.norm.weight.detach().float()
            _ms_per_call(exact, x, 3), _ms_per_call(int8, x, 3)  # warm-up
            times = {"float32": [], "int8": []}
            for _ in range(args.repeats):  # interleaved: both see the same machine
                times["float32"].append(_ms_per_call(exact, x, args.calls))
                times["int8"].append(_ms_per_call(int8, x, args.calls))
            f32, i8 = (statistics.median(times[k]) for k in ("float32", "int8"))
            same = (exact(x).argmax(-1) == int8(x).argmax(-1)).float().mean().item()
            rows.append({"rows": n, "float32_ms": f32, "int8_ms": i8, "same_top": same})
            print(f"| {n} | {f32:.3f} | {i8:.3f} | {f32 / i8:.1f}x | {same:.2f} |")
    return rows


if __name__ == "__main__":
    main()
