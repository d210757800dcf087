"""Atomic writes: a file or folder is built under a hidden temporary name beside its destination,
then renamed into place, so a reader never sees half of it and an interrupted write leaves the old
one. Every writer in eagle_tree goes through :func:`atomic_file`, :func:`atomic_dir` or
:func:`write_text` / :func:`write_bytes`. Temporary names carry the process id and a random part,
so two processes never share one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_dir", "atomic_file", "write_text", "write_bytes", "temp_prefix"]


def temp_prefix(path: Path) -> str:
    """Prefix of the temporary names of ``path``: hidden, and unique to this process."""
    return f".{path.name}.{os.getpid()}."


@contextmanager
def atomic_file(path: str | os.PathLike, mode: int = 0o644) -> Iterator[Path]:
    """Yield a temporary file path beside ``path`` (the file may be written by any means, e.g.
    ``torch.save``); on success it replaces ``path``, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_bytes(path, text.encode())


def _readable(folder: Path) -> None:
    """Give files that a writer created owner-only (safetensors writes 0600, as mkstemp does) the
    mode an ordinary file gets (0644), so a shipped folder is readable by whoever may read its
    parent; files and folders with other modes are left as written."""
    for p in folder.rglob("*"):
        if p.is_symlink():
            continue
        if p.is_file() and p.stat().st_mode & 0o777 == 0o600:
            p.chmod(0o644)
        elif p.is_dir() and p.stat().st_mode & 0o777 == 0o700:
            p.chmod(0o755)


@contextmanager
def atomic_dir(path: str | os.PathLike, keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path``; on success it replaces ``path`` (or, with
    ``keep_existing``, is dropped when another process created ``path`` meanwhile: a shared cache)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(path), dir=path.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        _readable(tmp)
        if path.exists() and keep_existing:
            return
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=temp_prefix(path) + "old.", dir=path.parent))
            old.rmdir()
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                tmp.rename(path)
            except OSError:  # created by another process since the check
                if not keep_existing:
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
