"""Output paths checked before any work: a command never deletes or overwrites what it did not write.

A command that writes a folder marks it with :data:`MARKER` (``{"kind": ...}``). Later runs of the
same kind may write there again; anything else (a regular file where a folder goes, a folder that
holds other files, a file of the same name that another program wrote) is refused with a message
that names the path and the option that forces the write (``overwrite=true``). Unwritable places
are refused too, so that no result is lost after the work is done.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from pathlib import Path

from eagle_tree.utils.atomic import write_text
from eagle_tree.utils.checks import InputError

MARKER = ".eagle-tree-output.json"


class OutputPathError(InputError):
    """An output path a command must not or cannot write."""


def check_output_dir(
    path: str | Path,
    kind: str,
    *,
    writes: Collection[str],
    replaces_folder: bool = False,
    overwrite: bool = False,
    option: str | None = "overwrite=true",
    recognise: Callable[[Path], bool] | None = None,
) -> Path:
    """Check that ``kind`` may write its entries ``writes`` into the folder ``path``.

    Allowed: no such path (its parent writable), an empty folder, a folder an earlier ``kind``
    wrote (its marker, or ``recognise(path)`` for folders written before markers existed), and,
    unless the folder is replaced as a whole (``replaces_folder``), a folder that holds none of the
    names ``writes``. An earlier ``kind`` folder that a replacing writer would clear must hold
    nothing but ``writes``. ``overwrite`` lifts the ownership checks; a regular file and an
    unwritable place are refused even then.
    """
    path = Path(path)
    _refuse_dangling_link(path, kind)
    if path.is_file() or (path.exists() and not path.is_dir()):
        raise OutputPathError(f"{path} is a file, but {kind} writes a folder there: choose another path "
                              "(or move the file away)")
    if not path.exists():
        _check_creatable(path, kind)
        return path
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputPathError(f"{path} is not writable: choose another folder for {kind}")
    entries = sorted(p.name for p in path.iterdir() if p.name != MARKER)
    if not entries or overwrite:
        return path
    force = f"; to replace it anyway, pass {option}" if option else ""
    ours = written_by(path) == kind or (recognise is not None and recognise(path))
    foreign = [e for e in entries if e not in writes]
    if ours:
        if replaces_folder and foreign:
            raise OutputPathError(f"{path} holds an earlier {kind} and also {_names(foreign)}, which {kind} did not "
                                  f"write and would delete: move them away or choose another folder{force}")
        return path
    if replaces_folder:
        what = f"an output of {written_by(path)}" if written_by(path) else f"{_names(entries)}"
        raise OutputPathError(f"{path} is not empty and is not an earlier {kind}: it holds {what}, which writing "
                              f"there would delete. Choose an empty or new folder{force}")
    clash = [e for e in entries if e in writes]
    if clash:
        raise OutputPathError(f"{path} already holds {_names(clash)}, not written by {kind}: choose another "
                              f"folder{force}")
    return path


def check_output_file(
    path: str | Path,
    kind: str,
    *,
    overwrite: bool = False,
    option: str = "overwrite=true",
    recognise: Callable[[Path], bool] | None = None,
) -> Path:
    """Check that ``kind`` may write the file ``path``: not a folder, in a writable place, and either
    new, recognised by ``recognise`` as an earlier output of ``kind``, or ``overwrite``."""
    path = Path(path)
    _refuse_dangling_link(path, kind)
    if path.is_dir():
        raise OutputPathError(f"{path} is a folder; {kind} writes a file there: name a file, e.g. {path / 'out.json'}")
    if not path.exists():
        _check_creatable(path, kind)
        return path
    if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{path} is not writable: choose another file for {kind}")
    if not overwrite and not (recognise is not None and recognise(path)):
        raise OutputPathError(f"{path} already exists and is not an earlier output of {kind}: choose another "
                              f"file, or pass {option} to replace it")
    return path


def mark_output_dir(path: str | Path, kind: str) -> None:
    """Record in the folder ``path`` (created if needed) that ``kind`` wrote it."""
    Path(path).mkdir(parents=True, exist_ok=True)
    write_text(Path(path) / MARKER, json.dumps({"kind": kind}) + "\n")


def written_by(path: str | Path) -> str | None:
    """The kind recorded by :func:`mark_output_dir` in the folder ``path``, or None."""
    try:
        return json.loads((Path(path) / MARKER).read_text())["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _refuse_dangling_link(path: Path, kind: str) -> None:
    if path.is_symlink() and not path.exists():
        raise OutputPathError(f"{path} is a symbolic link to {os.readlink(path)}, which does not exist: {kind} cannot "
                              "write through it; remove the link or choose another path")


def _check_creatable(path: Path, kind: str) -> None:
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputPathError(f"cannot create {path} for {kind}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot create {path} for {kind}: {parent} is not writable")


def _names(entries: list[str], limit: int = 5) -> str:
    shown = ", ".join(entries[:limit])
    return shown + (f" and {len(entries) - limit} more" if len(entries) > limit else "")
