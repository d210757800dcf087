"""Rows of a dataset, untokenised: the one reader of data files (a hub id, or local json / jsonl /
parquet / text files: a path, a glob, a folder or a list of them), with the checks that name the file
and line of what cannot be read, and the normaliser of chat messages (ShareGPT ``{from, value}`` or
``{role, content}``). Training (``eagle_tree.training.data``) tokenises these rows; regeneration and
the chat-data builder (``eagle_tree.reference``) continue them."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DataError", "BUILDERS", "CONVERSATION_FIELDS", "TEXT_FIELDS", "ROLES", "load_raw", "check_data_file",
           "normalize_messages"]


class DataError(ValueError):
    """A data file that cannot be read as training data; the message names the file (and line) and the fix."""

# file suffix -> datasets builder; compressed files (.gz, .zst, ...) are read by the same builder
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}
_COMPRESSION = {".gz", ".bz2", ".xz", ".zst", ".lz4"}
CONVERSATION_FIELDS = ("conversations", "messages")
TEXT_FIELDS = ("text",)
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system", "tool": "tool", "function": "tool", "observation": "tool", "ipython": "ipython",
}


def _local_files(source: str | Sequence[str]) -> list[str] | None:
    """The data files ``source`` names, or None when it is a hub id (a string that is no local path)."""
    items = [source] if isinstance(source, str | os.PathLike) else list(source)
    files: list[str] = []
    for item in map(str, items):
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(str(f) for f in path.rglob("*") if f.is_file() and _builder(f, strict=False)
                           and not any(p.startswith(".") for p in f.relative_to(path).parts))
            if not found:
                raise FileNotFoundError(f"no {'/'.join(BUILDERS)} files under {item!r}")
            files += found
        elif path.is_file():
            files.append(str(path))
        elif glob.has_magic(item):
            found = sorted(f for f in glob.glob(os.path.expanduser(item), recursive=True) if os.path.isfile(f))
            if not found:
                raise FileNotFoundError(f"no files match {item!r}")
            files += found
        elif isinstance(source, str | os.PathLike) and not _builder(path, strict=False):
            return None  # not a path: a hub id
        else:
            raise FileNotFoundError(f"no such data file or directory: {item!r}")
    return files


def _builder(path: Path, strict: bool = True) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in _COMPRESSION:
        suffixes.pop()
    builder = BUILDERS.get(suffixes[-1]) if suffixes else None
    if builder is None and strict:
        raise ValueError(f"cannot tell the format of {str(path)!r}; expected one of {', '.join(BUILDERS)}")
    return builder


def load_raw(source, split: str = "train", text_sample_by: str = "document", cache_dir: str | None = None):
    """The rows of ``source`` (a hub id, or local files: a path, glob, folder or a list of them) as a
    ``datasets.Dataset``, untokenised: the one reader of data files, for training and regeneration. A local
    file that is empty, not UTF-8 or holds a line that is not JSON raises DataError naming the file and line."""
    files = _local_files(source)
    if files == []:
        raise DataError(f"data.path={source!r} names no files; give a dataset (a hub id, a file, a folder or a glob)")
    for f in files or []:
        _check_utf8(Path(f))
        if Path(f).suffix.lower() == ".json":  # one document: rows, not a mapping of columns
            try:
                document = json.loads(Path(f).read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                continue  # JSON lines in a .json file
            _check_json_document(Path(f), document)
    try:
        return _read_raw(source, files, split, text_sample_by, cache_dir)
    except Exception:  # datasets' errors name neither file nor line: find them, else re-raise as it was
        for f in files or []:
            check_data_file(Path(f))
        raise


def _check_utf8(path: Path, block: int = 1 << 26) -> None:
    """Empty or not UTF-8 (read in blocks, C speed): a DataError naming the file and line, before
    ``datasets`` reads it (its JSON reader would keep broken bytes without a word)."""
    if _builder(path, strict=False) not in ("json", "text") or any(s.lower() in _COMPRESSION for s in path.suffixes):
        return
    if path.stat().st_size == 0:
        check_data_file(path)
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError:
                check_data_file(path)  # names the line
                raise
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            check_data_file(path)
            raise


def check_data_file(path: Path) -> None:
    """DataError if the (uncompressed) json / jsonl / text file ``path`` is empty, not UTF-8, or (jsonl) holds
    a line that is not a JSON object; the message names the file, the line and the fix."""
    builder = _builder(path, strict=False)
    if builder not in ("json", "text") or any(s.lower() in _COMPRESSION for s in path.suffixes):
        return
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); "
                        "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if not text.strip():
        raise DataError(f"{path} is empty: it holds no rows; remove it from data.path or fill it")
    if builder != "json":
        return
    if path.suffix.lower() == ".json":
        try:
            document = json.loads(text)
        except json.JSONDecodeError:
            document = None  # JSON lines in a .json file: check them line by line
        else:
            _check_json_document(path, document)
            return
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{i}: not valid JSON ({exc.msg} at column {exc.colno}); fix or remove the "
                            "line (each line of a .jsonl file is one JSON object)") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{i}: a JSON {type(row).__name__}, not an object with a text or "
                            "conversations field")


def _check_json_document(path: Path, document) -> None:
    """A .json file holding one document: a list of row objects (or one row); a mapping of columns is refused."""
    if isinstance(document, dict) and document and all(isinstance(v, list) for v in document.values()):
        raise DataError(f"{path} holds one JSON object of columns ({', '.join(map(repr, list(document)[:4]))}); a "
                        ".json data file holds a list of rows ([{\"text\": ...}, ...]) or one row object per line")
    if isinstance(document, list) and not all(isinstance(r, dict) for r in document):
        bad = next(i for i, r in enumerate(document) if not isinstance(r, dict))
        raise DataError(f"{path}: item {bad + 1} of the list is a JSON {type(document[bad]).__name__}, not a row "
                        "object with a text or conversations field")


def _read_raw(source, files: list[str] | None, split: str, text_sample_by: str, cache_dir: str | None):
    import datasets

    if files is None:  # hub id
        return datasets.load_dataset(source, split=split, cache_dir=cache_dir)
    builders = {_builder(Path(f)) for f in files}
    if len(builders) > 1:
        raise DataError(f"data files mix formats {sorted(builders)}; give files of one format")
    builder = builders.pop()
    kwargs = {"sample_by": text_sample_by} if builder == "text" else {}
    if len(files) == 1 or builder == "text":
        return datasets.load_dataset(builder, data_files=files, split=split, cache_dir=cache_dir, **kwargs)
    # Several files may carry different extra columns (e.g. corpus text beside regenerated rows with
    # metadata): read each, keep the columns they share, in order.
    parts = [datasets.load_dataset(builder, data_files=[f], split=split, cache_dir=cache_dir) for f in files]
    shared = [c for c in parts[0].column_names if all(c in p.column_names for p in parts[1:])]
    if not shared:
        raise DataError(f"the data files share no column: {[p.column_names for p in parts]}; give files with the "
                        "same text or conversations field")
    parts = [p.select_columns(shared) for p in parts]
    return datasets.concatenate_datasets([p.cast(parts[0].features) for p in parts])


def normalize_messages(messages: Sequence[dict]) -> list[dict[str, str]]:
    """ShareGPT ``{from, value}`` or ``{role, content}`` messages -> ``{role, content}`` with
    role in user/assistant/system/tool; assistant messages before the first other message are dropped."""
    out: list[dict[str, str]] = []
    for m in messages:
        role = m.get("role") if m.get("role") is not None else m.get("from")
        content = m.get("content") if m.get("content") is not None else m.get("value")
        if role is None:
            keys = sorted(k for k, v in m.items() if v is not None)
            raise ValueError(f"message has fields {keys}; expected 'from' and 'value', or 'role' and 'content'")
        if str(role).lower() not in ROLES:
            raise ValueError(f"unknown message role {role!r}; expected one of {sorted(ROLES)}")
        role = ROLES[str(role).lower()]
        if role == "assistant" and not out:
            continue  # a leading reply has no prompt
        out.append({"role": role, "content": "" if content is None else str(content)})
    return out
