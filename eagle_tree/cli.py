"""The ``eagle-tree`` command line: ``eagle-tree <command> [--config FILE] [key=value ...]``.

Each command lives in its own module with a ``main(argv)`` function, imported only when run, so
the command line stays fast and a command's heavy dependencies load only for that command.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("eagle_tree.commands.train", "train an EAGLE-3 draft head on a dataset"),
    "chat-data": ("eagle_tree.commands.chat_data", "synthesise two-turn chat data with the target (Magpie)"),
    "regenerate": ("eagle_tree.commands.regenerate", "continue dataset rows with the target (training data)"),
    "decode": ("eagle_tree.commands.decode", "decode prompts with a draft head (tree, chain or plain)"),
    "bench": ("eagle_tree.commands.bench", "benchmark eagle-tree against baselines"),
    "quickstart": ("eagle_tree.commands.quickstart", "train a head on the reference target and compare"),
    "export": ("eagle_tree.commands.export", "export a head to the EAGLE-3, SGLang or vLLM layout"),
    "demo": ("eagle_tree.commands.demo", "show the exact verifier on a three-token example"),
    "reference": ("eagle_tree.commands.reference", "locate and convert a reference target (smollm2)"),
}
# (command, first argument) -> (module, one-line help): a command's mode with a schema of its own
SUBCOMMANDS: dict[tuple[str, str], tuple[str, str]] = {
    ("bench", "serving"): ("eagle_tree.commands.bench_serving", "batch sizes, contexts, output lengths and load"),
}


def _usage() -> str:
    lines = ["usage: eagle-tree <command> [--config FILE] [key=value ...]", "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()]
    lines += [f"  {' '.join(key)}  {text}" for key, (_, text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"eagle-tree: unknown command {name!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    if rest and (name, rest[0]) in SUBCOMMANDS:
        module_name, rest = SUBCOMMANDS[name, rest[0]][0], rest[1:]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"eagle-tree {name}: not yet available in this version of eagle-tree", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
