"""Plot a head's training curve: acceptance length and top-1 agreement against hours of training.

    python train/curve.py runs/smollm2/head/train_summary.json runs/smollm2/head2/train_summary.json \
        --out docs/training/smollm2-curve.png

Each argument is a run's ``train_summary.json`` (its ``evals``: ``train_minutes``, the chain and tree
acceptance lengths and the agreement per draft step). Several runs are one curve when each started
from the previous one's weights (``model.init_from``): run k's clock starts where run k-1's steps
ended. Prints the table of points (markdown) and writes the PNG.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def points(summaries: list[Path]) -> list[dict]:
    """One row per evaluation, on one clock of training hours across the chained runs."""
    rows, offset = [], 0.0
    for k, path in enumerate(summaries):
        summary = json.loads(Path(path).read_text())
        evals = summary.get("evals") or []
        if not evals:
            raise SystemExit(f"{path} has no evaluations (eval.every_minutes / eval.at_end in the run's config)")
        for ev in evals:
            rows.append({"run": k, "hours": (offset + ev["train_minutes"]) / 60, "start": offset / 60,
                         "step": ev["step"],
                         "chain": ev.get("acceptance_length_chain"), "tree": ev.get("acceptance_length_tree"),
                         "agreement": ev.get("agreement") or []})
        offset += max(ev["train_minutes"] for ev in evals)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| run | hours of steps | step | chain | tree | agreement per step |", "|---|---|---|---|---|---|"]
    for r in rows:
        agree = " / ".join(f"{a:.3f}" for a in r["agreement"])
        lines.append(f"| {r['run']} | {r['hours']:.2f} | {r['step']} | {r['chain']:.2f} | {r['tree']:.2f} | {agree} |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = [r["hours"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(hours, [r["chain"] for r in rows], "o-", label="chain of 4")
    ax1.plot(hours, [r["tree"] for r in rows], "s-", label="tree")
    ax1.set(xlabel="hours of training", ylabel="tokens per round (greedy)", title="acceptance length")
    for step in range(max(len(r["agreement"]) for r in rows)):
        ax2.plot(hours, [r["agreement"][step] if step < len(r["agreement"]) else None for r in rows], "o-",
                 label=f"draft step {step}")
    ax2.set(xlabel="hours of training", ylabel="top-1 agreement with the target", title="agreement", ylim=(0, 1))
    for ax in (ax1, ax2):
        for k in sorted({r["run"] for r in rows})[1:]:
            ax.axvline(next(r["start"] for r in rows if r["run"] == k), color="grey", lw=0.8, ls=":")  # run k starts
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summaries", nargs="+", type=Path, help="train_summary.json of each chained run, in order")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--title", default="head training curve (evaluations on the tuning prompts)")
    args = ap.parse_args(argv)
    rows = points(args.summaries)
    print(table(rows))
    plot(rows, args.out, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
