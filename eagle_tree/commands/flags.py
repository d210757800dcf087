"""``--name value`` flags and positional arguments as the ``key=value`` overrides of ``parse_cli``.

Every command reads its options through one dataclass schema and ``eagle_tree.utils.config.parse_cli``;
``export`` and ``demo`` also accept the conventional spelling, translated here before parsing::

    eagle-tree export --to vllm HEAD OUT --speculative-tokens 5 --overwrite
    eagle-tree export to=vllm checkpoint=HEAD out=OUT speculative_tokens=5 overwrite=true   # the same

A flag's dashes become underscores; a flag of a ``bool`` field without a value means true; bare
arguments fill the ``positional`` fields in order. Unknown names reach the parser, which names the
closest key.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import TypeVar, get_type_hints

from eagle_tree.utils.config import parse_cli

T = TypeVar("T")


def flags_to_overrides(schema: type, argv: Sequence[str], positional: Sequence[str] = ()) -> list[str]:
    """``argv`` with every flag and positional argument rewritten as ``key=value``."""
    hints = get_type_hints(schema)
    fields = {f.name for f in dataclasses.fields(schema)}
    args, out, free = list(argv), [], list(positional)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help") or arg == "--config" or arg.startswith("--config="):
            out.append(arg)
            if arg == "--config" and args:
                out.append(args.pop(0))
        elif arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            name = name.replace("-", "_")
            if not eq:
                if hints.get(name) is bool and name in fields:
                    value = "true"
                elif args and not args[0].startswith("--"):
                    value = args.pop(0)
                else:
                    raise ValueError(f"option --{arg[2:]} needs a value")
            out.append(f"{name}={value}")
        elif "=" not in arg:
            if not free:
                raise ValueError(f"unexpected argument {arg!r}: expected at most {len(positional)} positional "
                                 f"argument(s) ({', '.join(positional) or 'none'}), then key=value overrides")
            out.append(f"{free.pop(0)}={arg}")
        else:
            out.append(arg)
    return out


def parse_flags(schema: type[T], argv: Sequence[str], prog: str, positional: Sequence[str] = ()) -> T:
    """:func:`flags_to_overrides`, then ``parse_cli``; a malformed command line exits with status 2."""
    try:
        overrides = flags_to_overrides(schema, argv, positional)
    except ValueError as exc:
        print(f"usage: {prog} [--config FILE] [key=value ...]\n{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    return parse_cli(schema, overrides, prog=prog)
