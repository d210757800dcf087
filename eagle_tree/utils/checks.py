"""Checks of what a user hands a command, each failing with an :class:`InputError` that names the
problem and the fix (commands print it and exit with status 2, without a traceback)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from eagle_tree.utils.config import ConfigValueError

__all__ = ["InputError", "reading", "check_range", "check_ranges", "check_finite_weights", "nonfinite_weights",
           "check_target_path"]


class InputError(ValueError):
    """An input (path, file, model, value) the user must change; the message says how."""


def exit_on_input_error(prog: str, run, cfg, anticipated: tuple[type[BaseException], ...] = (),
                        interrupted=None) -> int:
    """``run(cfg)`` for a command, its one error boundary: an :class:`InputError` (or one of the
    ``anticipated`` kinds) is printed as ``prog: message`` (no traceback) and gives exit status 2; any
    other error keeps its traceback. Ctrl-C gives one line (``interrupted()`` adds what was saved and
    how to continue) and exit status 130."""
    import sys

    try:
        return run(cfg)
    except (InputError, *anticipated) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        extra = interrupted() if interrupted is not None else ""
        print(f"{prog}: interrupted" + (f"; {extra}" if extra else ""), file=sys.stderr)
        return 130


@contextlib.contextmanager
def reading(what: str, fix: str = ""):
    """Turn the errors of reading ``what`` (a file, a model folder) into one :class:`InputError` line
    naming it and ``fix``: ValueError (JSON included), KeyError, TypeError and OSError. An InputError
    raised inside passes unchanged; anything else keeps its traceback."""
    try:
        yield
    except InputError:
        raise
    except (ValueError, KeyError, TypeError, OSError) as exc:
        reason = f"no key {exc}" if isinstance(exc, KeyError) else (str(exc).strip().splitlines() or [""])[0]
        raise InputError(f"{what}: {reason or exc.__class__.__name__}" + (f"; {fix}" if fix else "")) from exc


def check_range(name: str, value, low: float, allow_none: bool = False, meaning: str = "",
                integer: bool = True) -> None:
    """A config value that must be an integer (or, with ``integer=False``, a finite number) >= ``low`` (or
    None when ``allow_none``; ``meaning`` says what None means); NaN and infinities are refused. Raises a
    ValueError naming the key, for a schema's ``__post_init__`` (``parse_cli`` reports it with the dotted key)."""
    if value is None and allow_none:
        return
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value < low:
        alternative = " or null" + (f" ({meaning})" if meaning else "") if allow_none else ""
        what = "an integer" if integer else "a finite number"
        raise ConfigValueError(name, f"must be {what} >= {low}{alternative}, got {value!r}")


def check_ranges(cfg, **lows: float) -> None:
    """:func:`check_range` for several fields of ``cfg`` at once: an int bound asks for an integer, a float
    bound for a number; None passes (the schema's types say where None is allowed)."""
    for name, low in lows.items():
        value = getattr(cfg, name)
        if value is not None:
            check_range(name, value, low, integer=not isinstance(low, float))


def nonfinite_weights(module_or_state: torch.nn.Module | dict) -> list[str]:
    """Names of the floating-point parameters and buffers (or state-dict entries) holding a NaN or an infinity."""
    import torch

    if isinstance(module_or_state, torch.nn.Module):
        tensors = dict(module_or_state.named_parameters())
        tensors |= {k: v for k, v in module_or_state.named_buffers() if k not in tensors}
    else:
        tensors = module_or_state
    return [name for name, t in tensors.items()
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


def check_finite_weights(module_or_state: torch.nn.Module | dict, what: str) -> None:
    """Refuse a model (or state dict) with a NaN or infinite weight: ``what`` names it in the error,
    with the tensors concerned. Such a head comes from a training that diverged."""
    bad = nonfinite_weights(module_or_state)
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise InputError(f"{what} has non-finite (NaN or infinite) weights in {shown}: it comes from a training "
                         "that diverged; use an earlier checkpoint or train again with a lower learning rate")


def check_target_path(target: str, key: str = "target") -> None:
    """Refuse a ``target`` that is neither a model folder nor a hub id before Hugging Face tries it:
    a path that does not exist, a file, or a draft head's folder."""
    path = Path(target).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return  # a GGUF file: eagle_tree.models.gguf reads it and names what is wrong with it
    if path.is_file():
        raise InputError(f"{key}={target} is a file; expected a model folder (config.json, weights, tokenizer), "
                         "a .gguf file or a hub id such as meta-llama/Llama-3.1-8B-Instruct")
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise InputError(f"{key}={target} holds no config.json: is it a Hugging Face model folder?")
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError) as exc:
            raise InputError(f"{config} is not valid JSON ({exc})") from exc
        if isinstance(data, dict) and ({"draft_vocab_size", "speculators_model_type"} & set(data)):
            raise InputError(f"{key}={target} is an EAGLE-3 draft head, not a target model: pass it as head= and "
                             "the model it was trained for as target=")
        return
    looks_local = target.startswith((".", "/", "~")) or target.count("/") > 1 or target.endswith("/")
    if looks_local:
        raise InputError(f"{key}={target}: no such folder (a hub id has the form namespace/name); check the path, "
                         "or run from the folder it is relative to")
