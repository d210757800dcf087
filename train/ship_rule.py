"""Judge a candidate head against the shipped one by a ship rule fixed before training.

    python train/ship_rule.py runs/smollm2/head16-tuning84.json \
        docs/training/smollm2-head-report/head15-tuning84.json

Both arguments are reports from ``decode/head_report.py`` on the same prompts and settings: the
candidate's first, the bar's second. The rule (the sixteenth run's entry in docs/TRAINING.md): the
candidate ships when no judged figure falls below the bar by more than its tolerance (tree and
chain acceptance: ``--acceptance-tol`` tokens a round; agreement at each judged draft step:
``--agreement-tol``), and at least one of the ``--gain`` figures rises above the bar by more than
its tolerance. Prints a table of every figure with its change and verdict, then the decision; the
exit status is 0 when the candidate ships and 1 when it does not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SAME = ("prompts", "num_prompts", "max_new_tokens", "chain", "tree")  # what must match between the reports


def figures(report: dict, steps: int) -> dict[str, float]:
    agreement = report["agreement_per_step"]
    if len(agreement) < steps:
        raise SystemExit(f"the report has agreement for {len(agreement)} draft steps, {steps} are judged; "
                         "pass --steps N with N at most that")
    out = {"tree": report["acceptance_length_tree"], "chain": report["acceptance_length_chain"]}
    out.update({f"agreement_{i}": agreement[i] for i in range(steps)})
    return out


def judge(candidate: dict, bar: dict, *, acceptance_tol: float = 0.005, agreement_tol: float = 0.002,
          steps: int = 4, gain: tuple[str, ...] = ("tree", "chain", "agreement_0")) -> dict:
    """Every judged figure's change and verdict, and whether the candidate ships."""
    differ = [k for k in SAME if k in candidate and k in bar and candidate[k] != bar[k]]
    if differ:
        raise SystemExit(f"the reports differ in {', '.join(differ)}: run both heads with the same "
                         "decode/head_report.py settings")
    cand, ref = figures(candidate, steps), figures(bar, steps)
    unknown = [g for g in gain if g not in cand]
    if unknown:
        raise SystemExit(f"--gain names {unknown}, which are not judged figures ({', '.join(cand)})")
    rows = []
    for name in cand:
        tol = acceptance_tol if name in ("tree", "chain") else agreement_tol
        delta = cand[name] - ref[name]
        verdict = "falls" if delta < -tol else ("rises" if delta > tol else "level")
        rows.append({"figure": name, "bar": ref[name], "candidate": cand[name], "delta": delta,
                     "tolerance": tol, "verdict": verdict})
    falls = [r["figure"] for r in rows if r["verdict"] == "falls"]
    rises = [r["figure"] for r in rows if r["verdict"] == "rises" and r["figure"] in gain]
    return {"rows": rows, "falls": falls, "rises": rises, "ships": not falls and bool(rises)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python train/ship_rule.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("candidate", help="the candidate head's decode/head_report.py JSON")
    ap.add_argument("bar", help="the shipped head's report on the same prompts and settings")
    ap.add_argument("--acceptance-tol", type=float, default=0.005, help="tokens a round (tree and chain)")
    ap.add_argument("--agreement-tol", type=float, default=0.002, help="top-1 agreement at each draft step")
    ap.add_argument("--steps", type=int, default=4, help="draft steps whose agreement is judged (from 0)")
    ap.add_argument("--gain", default="tree,chain,agreement_0",
                    help="comma-separated figures of which at least one must rise")
    args = ap.parse_args(argv)
    reports = [json.loads(Path(p).read_text()) for p in (args.candidate, args.bar)]
    for path, report in zip((args.candidate, args.bar), reports, strict=True):
        if "agreement_per_step" not in report:
            raise SystemExit(f"{path} has no agreement_per_step: not a decode/head_report.py output")
    result = judge(*reports, acceptance_tol=args.acceptance_tol, agreement_tol=args.agreement_tol,
                   steps=args.steps, gain=tuple(g for g in args.gain.split(",") if g))
    print("| figure | bar | candidate | change | tolerance | verdict |\n|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['figure']} | {r['bar']:.4f} | {r['candidate']:.4f} | {r['delta']:+.4f} | "
              f"{r['tolerance']:g} | {r['verdict']} |")
    if result["ships"]:
        print(f"ships: nothing falls beyond its tolerance; rises: {', '.join(result['rises'])}")
    else:
        why = [f"falls: {', '.join(result['falls'])}"] if result["falls"] else []
        why += [] if result["rises"] else [f"none of {args.gain} rises beyond its tolerance"]
        print(f"does not ship ({'; '.join(why)})")
    return 0 if result["ships"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
