"""Prompt files, read in one place, and prompts turned into token ids a target can decode.

A prompt file is one of:

- ``.jsonl``: one JSON object per line with a string field ``prompt`` (blank lines are skipped);
- ``.json``: a JSON list of strings or of objects with a ``prompt`` field, or JSON lines as above;
- anything else: plain text, one prompt per non-blank line.

Every error names the file and, where there is one, the line, and says what was expected.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, NamedTuple

from eagle_tree.utils.checks import InputError


class PromptError(InputError):
    """A prompt file or a prompt that cannot be decoded as given."""


class Prompt(NamedTuple):
    text: str
    where: str
    """``FILE:LINE`` (or ``FILE[i]`` for a JSON list) of the prompt, for error messages."""


def read_prompts(path: str | Path) -> list[str]:
    """The prompt texts of a file (see the module docstring)."""
    return [p.text for p in read_prompt_file(path)]


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """The prompts of a file, each with its place in the file; an empty file is an error."""
    path = Path(path)
    if path.is_dir():
        raise PromptError(f"prompt file {str(path)!r} is a folder; expected a .jsonl, .json or text file")
    if not path.is_file():
        raise PromptError(f"prompt file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"prompt file {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); "
                          "convert it to UTF-8") from exc
    if path.suffix == ".json":
        prompts = _json_document(text, path)
    elif path.suffix == ".jsonl":
        prompts = _json_lines(text, path)
    else:
        prompts = [Prompt(line, f"{path}:{i + 1}") for i, line in enumerate(text.splitlines()) if line.strip()]
    if not prompts:
        raise PromptError(f"prompt file {path} holds no prompts")
    return prompts


def _json_document(text: str, path: Path) -> list[Prompt]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _json_lines(text, path)  # a .json file of JSON lines
    if not isinstance(data, list):
        raise PromptError(f"{path}: expected a JSON list of prompts (strings or objects with a 'prompt' field) "
                          f"or JSON lines, found a {type(data).__name__}")
    return [Prompt(_prompt_text(row, f"{path}[{i}]"), f"{path}[{i}]") for i, row in enumerate(data)]


def _json_lines(text: str, path: Path) -> list[Prompt]:
    prompts = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be an "
                              'object like {"prompt": "..."}') from exc
        prompts.append(Prompt(_prompt_text(row, where), where))
    return prompts


def _prompt_text(row, where: str) -> str:
    if isinstance(row, str):
        return row
    if not isinstance(row, dict):
        raise PromptError(f"{where}: expected an object with a 'prompt' field, found {json.dumps(row)[:80]}")
    if "prompt" not in row:
        raise PromptError(f"{where}: expected a 'prompt' field, found {sorted(row)}")
    if not isinstance(row["prompt"], str):
        raise PromptError(f"{where}: the 'prompt' field must be a string, found {type(row['prompt']).__name__}")
    return row["prompt"]


def warn_if_foreign_tokenizer(tokenizer, vocab_size: int) -> bool:
    """Warn (stderr) when the tokenizer knows fewer than half of the target's ``vocab_size`` ids: models pad
    their vocabulary a little, never by half, so it most likely belongs to another model and the output
    will be nonsense. Returns whether it warned."""
    import sys

    try:
        size = len(tokenizer)
    except TypeError:
        return False
    if size * 2 >= vocab_size:
        return False
    print(f"warning: the tokenizer has {size} tokens but the target's vocabulary has {vocab_size} ids: it most "
          "likely belongs to another model (the continuations will be nonsense); use the target's own tokenizer",
          file=sys.stderr, flush=True)
    return True


def encode_prompts(
    tokenizer,
    prompts: Sequence[str | Prompt],
    *,
    vocab_size: int,
    max_positions: int | None,
    max_new_tokens: int,
    truncate: Literal["off", "left"] = "off",
    max_prompt_tokens: int | None = None,
):
    """Token ids (1, T) of each prompt, checked against the target: no empty prompt, every id inside
    its vocabulary (``vocab_size``), and prompt + ``max_new_tokens`` within its ``max_positions`` (None:
    no limit). A longer prompt is refused, or with ``truncate="left"`` cut to its last tokens; a
    ``max_prompt_tokens`` limit always keeps the last tokens."""
    import torch

    warn_if_foreign_tokenizer(tokenizer, vocab_size)
    budget = None if max_positions is None else max_positions - max_new_tokens
    if budget is not None and budget < 1:
        raise PromptError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the target's "
                          f"{max_positions} positions: lower max_new_tokens")
    encoded = []
    for i, prompt in enumerate(prompts):
        text, where = (prompt.text, prompt.where) if isinstance(prompt, Prompt) else (prompt, None)
        name = f"prompt {i}" + (f" ({where})" if where else "")
        ids = list(tokenizer.encode(text))
        if max_prompt_tokens is not None:
            ids = ids[-max_prompt_tokens:]
        if not ids:
            raise PromptError(f"{name} is empty after tokenization: give it some text")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise PromptError(f"{name} holds token id {bad[0]}, outside the target's vocabulary of {vocab_size} "
                              "ids: the tokenizer does not match the target model")
        if budget is not None and len(ids) > budget:
            if truncate != "left":
                raise PromptError(
                    f"{name} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it needs "
                    f"{len(ids) + max_new_tokens} positions, but the target has {max_positions}: shorten it, "
                    f"lower max_new_tokens, or set truncate_prompts=left to keep its last {budget} tokens")
            ids = ids[-budget:]
        encoded.append(torch.tensor([ids], dtype=torch.long))
    return encoded


def max_positions(config) -> int | None:
    """The context length of a Hugging Face model config (None when it names none)."""
    get = getattr(config, "get_text_config", None)
    text_config = get(decoder=True) if callable(get) else config
    value = getattr(text_config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def encode_for_target(prompts, target, tokenizer, max_new_tokens: int, truncate: str):
    """Token ids of ``prompts`` for ``target`` (a TargetModel): checked against its vocabulary and
    positions (:func:`encode_prompts`)."""
    return encode_prompts(tokenizer, prompts, vocab_size=target.vocab_size, max_positions=max_positions(target.config),
                          max_new_tokens=max_new_tokens, truncate=truncate)
