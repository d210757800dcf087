"""``eagle-tree regenerate``: continue dataset rows with the target and write them as a jsonl dataset.

    eagle-tree regenerate data=stdlib:assets/reference/manifest.json#train output=runs/regen/data.jsonl \\
        "temperatures=[0.0, 1.0]" limit=4096

Train a head on the result (alone, or beside the original data: ``data.path=[A, B]``). Rerunning the
same command after an interruption resumes from the finished batches (see eagle_tree.reference.regenerate).
"""

from __future__ import annotations

from eagle_tree.utils.config import parse_cli

PROG = "eagle-tree regenerate"


def main(argv: list[str]) -> int:
    from eagle_tree.data.rows import DataError
    from eagle_tree.reference.regenerate import RegenerateConfig
    from eagle_tree.utils.checks import exit_on_input_error

    cfg = parse_cli(RegenerateConfig, argv, prog=PROG)
    return exit_on_input_error(PROG, run, cfg, (DataError, FileNotFoundError),
                               interrupted=lambda: "the finished batches are kept in OUTPUT.partial; rerun the same "
                                                   "command to resume")


def run(cfg) -> int:
    from eagle_tree.reference.regenerate import regenerate

    result = regenerate(cfg)
    print(f"[eagle-tree regenerate] {result['rows']} rows ({result['new_tokens_this_run']} new tokens this run, "
          f"{result['resumed_batches']} batches resumed) -> {result['output']}")
    return 0
