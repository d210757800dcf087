"""Train variants of a training config for equal wall-clock budgets and compare them (the library does the
work: eagle_tree.training.study).

    python train/study.py --config configs/study-reference.yaml
    python train/study.py --config configs/study-reference.yaml "only=[baseline, init-target]" minutes=5
    python train/study.py --help

Writes OUTPUT_DIR/VARIANT/ (each run), results.json, table.md and curves.png; each variant is its own W&B run.
"""

from __future__ import annotations

import sys

from eagle_tree.training.study import StudyConfig, run_study
from eagle_tree.utils.config import parse_cli


def main(argv: list[str] | None = None) -> int:
    study = parse_cli(StudyConfig, sys.argv[1:] if argv is None else argv, prog="study.py")
    run_study(study)
    return 0


if __name__ == "__main__":
    sys.exit(main())
