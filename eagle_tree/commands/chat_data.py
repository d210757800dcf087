"""``eagle-tree chat-data``: synthesise chat training data with the target (eagle_tree.reference.chat_data).

    TARGET=$(eagle-tree reference smollm2 | tail -1)
    eagle-tree chat-data --config configs/chat-data-smollm2.yaml target=$TARGET

Rerunning the same command resumes after the last finished batch; a larger ``conversations`` extends the data.
"""

from __future__ import annotations

import sys

from eagle_tree.utils.config import parse_cli


def main(argv: list[str]) -> int:
    from eagle_tree.reference.chat_data import ChatDataConfig, build_chat_data

    cfg = parse_cli(ChatDataConfig, argv, prog="eagle-tree chat-data")
    try:
        summary = build_chat_data(cfg)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"eagle-tree chat-data: {exc}", file=sys.stderr)
        return 2
    print(f"[eagle-tree chat-data] {summary['conversations']} conversations ({summary['two_turn']} of two turns; "
          f"train/tuning/test {summary['by_split']['train']}/{summary['by_split']['tuning']}/"
          f"{summary['by_split']['test']}), {summary['generated_reply_tokens']} reply tokens in "
          f"{summary['seconds']:.0f} s -> {cfg.output}")
    return 0
