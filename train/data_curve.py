"""Held-out acceptance against the number of training conversations a head has seen, with a fitted trend.

    python train/data_curve.py 623=docs/training/smollm2-head-report/head5-test54.json \
        818=docs/training/smollm2-head-report/head6-test54.json ... \
        --target 0.75 --out docs/training/smollm2-data-curve.png

Each argument is ``CONVERSATIONS=REPORT``: a head's report from ``decode/head_report.py`` on the same
prompts, and how many training conversations that head had seen. Fits top-1 agreement at each draft
step, and the chain's acceptance length, as a straight line in log2(conversations) (least squares),
prints the points, the slope per doubling of the data and, for ``--target``, the conversations at
which the step-0 line would reach it. The line is a trend read off the points, not a law: the heads
were trained one after another (each warm-started from the previous one), so data and training time
grew together, and a projection far beyond the points is only as good as the trend.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def read_points(specs: list[str]) -> list[dict]:
    rows = []
    for spec in specs:
        convs, sep, path = spec.partition("=")
        if not sep or not convs.isdigit() or int(convs) <= 0:
            raise SystemExit(f"{spec!r}: expected CONVERSATIONS=REPORT, e.g. 2534=head9-test54.json")
        report = json.loads(Path(path).read_text())
        if "agreement_per_step" not in report:
            raise SystemExit(f"{path} has no agreement_per_step: not a decode/head_report.py output")
        rows.append({"conversations": int(convs), "report": path, "prompts": report.get("prompts"),
                     "num_prompts": report.get("num_prompts"), "chain": report["acceptance_length_chain"],
                     "tree": report["acceptance_length_tree"], "agreement": report["agreement_per_step"]})
    keys = {(r["prompts"], r["num_prompts"]) for r in rows}
    if len(keys) > 1:
        raise SystemExit(f"the reports were run on different prompts ({sorted(map(str, keys))}); "
                         "compare heads on one prompt set")
    if len({r["conversations"] for r in rows}) < 2:
        raise SystemExit("a trend needs heads trained on at least two data sizes")
    return sorted(rows, key=lambda r: r["conversations"])


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx


def analyse(rows: list[dict], target: float | None) -> dict:
    xs = [math.log2(r["conversations"]) for r in rows]
    series = {"chain": [r["chain"] for r in rows]}
    for step in range(min(len(r["agreement"]) for r in rows)):
        series[f"agreement_{step}"] = [r["agreement"][step] for r in rows]
    fits = {}
    for name, ys in series.items():
        slope, intercept = fit(xs, ys)
        fits[name] = {"per_doubling": slope, "intercept": intercept}
    out = {"points": rows, "fits": fits}
    if target is not None:
        slope, intercept = fits["agreement_0"]["per_doubling"], fits["agreement_0"]["intercept"]
        out["target"] = target
        out["conversations_at_target"] = 2 ** ((target - intercept) / slope) if slope > 0 else None
    return out


def plot(result: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["points"]
    convs = [r["conversations"] for r in rows]
    lo, hi = min(convs), max(convs)
    grid_hi = max(hi * 4, result.get("conversations_at_target") or 0) if result.get("target") else hi * 4
    grid = [lo * (grid_hi / lo) ** (i / 50) for i in range(51)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, fitted in result["fits"].items():
        if not name.startswith("agreement_"):
            continue
        step = int(name.split("_")[1])
        (line,) = ax1.plot(convs, [r["agreement"][step] for r in rows], "o", label=f"draft step {step}")
        ax1.plot(grid, [fitted["intercept"] + fitted["per_doubling"] * math.log2(g) for g in grid], "--",
                 color=line.get_color(), lw=1)
    if result.get("target") is not None:
        ax1.axhline(result["target"], color="grey", lw=0.8)
        ax1.text(lo, result["target"] + 0.01, f"target {result['target']}", fontsize=8, color="grey")
    ax1.set(xscale="log", xlabel="training conversations (log scale)", ylabel="top-1 agreement, held out",
            title="agreement: points and log-linear trend (dashed)", ylim=(0, 1))
    chain = result["fits"]["chain"]
    ax2.plot(convs, [r["chain"] for r in rows], "o", label="chain of 4")
    ax2.plot(grid, [chain["intercept"] + chain["per_doubling"] * math.log2(g) for g in grid], "--", lw=1)
    ax2.set(xscale="log", xlabel="training conversations (log scale)", ylabel="tokens per round (greedy)",
            title="chain-of-4 acceptance length")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("points", nargs="+", help="CONVERSATIONS=REPORT, one per head")
    ap.add_argument("--target", type=float, default=None, help="step-0 agreement to project the data for")
    ap.add_argument("--out", type=Path, default=None, help="PNG to write")
    ap.add_argument("--title", default="held-out agreement against training data")
    args = ap.parse_args(argv)
    result = analyse(read_points(args.points), args.target)
    print("| training conversations | chain of 4 | tree | agreement at draft steps |")
    print("|---|---|---|---|")
    for r in result["points"]:
        agree = " / ".join(f"{a:.3f}" for a in r["agreement"])
        print(f"| {r['conversations']:,} | {r['chain']:.2f} | {r['tree']:.2f} | {agree} |")
    for name, fitted in result["fits"].items():
        print(f"{name}: {fitted['per_doubling']:+.4f} per doubling of the conversations")
    if args.target is not None:
        at = result["conversations_at_target"]
        print(f"step-0 agreement {args.target} on the trend: " +
              (f"about {at:,.0f} conversations ({at / result['points'][-1]['conversations']:.0f}x the largest "
               "point)" if at else "never (the trend does not rise)"))
    if args.out:
        plot(result, args.out, args.title)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
