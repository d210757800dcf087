"""Atomic folder writes: build in a hidden temporary sibling, then swap it in with renames, so a
reader never sees a half-written head or checkpoint and an interrupted write leaves the old one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path``; on success it replaces ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
