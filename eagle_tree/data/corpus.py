"""The reference corpus: the Python standard library's own source files, split by file.

Every Python installation carries its standard library, so this corpus exists on every machine
without a dataset hub. Files are split by file (never by line) into ``train`` / ``tuning`` /
``test`` with a seeded shuffle, and the split is pinned in a manifest (relative paths, sizes,
sha256, Python version) so that later runs read exactly the same texts.

Fallback rule when the local standard library differs from the manifest (another Python
version, a patched install): :func:`load_split` raises :class:`CorpusMismatchError` naming the
missing and changed files. With ``strict=False`` it instead keeps only the files whose hash
matches and drops the rest with a warning; the split membership never changes, so held-out files
stay held out. The shipped reference models are trained once and used as they are; nobody needs
the corpus to use them, only to rebuild or re-evaluate them.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import sysconfig
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from eagle_tree.utils.atomic import write_text

SPLITS = ("train", "tuning", "test")

# directory names excluded anywhere in a relative path
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__",
     "lib2to3", "turtledemo", "ensurepip", "config-3"}
)


class CorpusMismatchError(RuntimeError):
    """The local standard library does not match the files pinned in a manifest."""


def stdlib_dir() -> Path:
    """The directory of this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: Path) -> bool:
    parts = rel.parts
    if any(p in EXCLUDED_DIRS or p.startswith("config-") for p in parts[:-1]):
        return True
    name = parts[-1]
    return name.startswith("test_") or name == "__phello__.foo.py"


def find_source_files(root: Path | None = None) -> list[Path]:
    """Relative paths of the ``.py`` files under ``root`` (default: the stdlib), tests excluded, sorted."""
    root = Path(root) if root is not None else stdlib_dir()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not _excluded(rel) and path.is_file():
            files.append(rel)
    return sorted(files, key=lambda p: p.as_posix())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Manifest:
    """Which files make up each split, with enough detail to verify them later."""

    root: str
    """Absolute path of the source directory when the manifest was built (informative only)."""
    python_version: str
    """``sys.version`` of the interpreter whose standard library was used."""
    seed: int
    """Seed of the shuffle that assigned files to splits."""
    fractions: dict[str, float]
    """Fraction of files in each split."""
    files: dict[str, list[dict]] = field(default_factory=dict)
    """split -> list of ``{"path", "size", "sha256"}``, paths relative to ``root`` in POSIX form."""

    def paths(self, split: str) -> list[str]:
        return [f["path"] for f in self.files[split]]

    def to_json(self) -> dict:
        return {"root": self.root, "python_version": self.python_version, "seed": self.seed,
                "fractions": self.fractions, "files": self.files}

    def save(self, path: str | Path) -> None:
        write_text(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        d = json.loads(Path(path).read_text())
        return cls(root=d["root"], python_version=d["python_version"], seed=d["seed"],
                   fractions=d["fractions"], files=d["files"])


def build_manifest(
    root: Path | None = None, seed: int = 0, fractions: tuple[float, float, float] = (0.9, 0.05, 0.05)
) -> Manifest:
    """Split the source files of ``root`` by file into train / tuning / test with a seeded shuffle.

    The shuffle runs over the sorted relative paths, so the split depends only on the file list
    and the seed. Empty files are skipped.
    """
    root = Path(root) if root is not None else stdlib_dir()
    entries = []
    for rel in find_source_files(root):
        data = (root / rel).read_bytes()
        if data.strip():
            entries.append({"path": rel.as_posix(), "size": len(data), "sha256": _sha256(data)})
    order = list(range(len(entries)))
    random.Random(seed).shuffle(order)
    n = len(entries)
    n_tuning = max(1, round(fractions[1] * n))
    n_test = max(1, round(fractions[2] * n))
    groups = {"tuning": order[:n_tuning], "test": order[n_tuning:n_tuning + n_test],
              "train": order[n_tuning + n_test:]}
    files = {s: sorted((entries[i] for i in groups[s]), key=lambda e: e["path"]) for s in SPLITS}
    return Manifest(root=str(root), python_version=sys.version, seed=seed,
                    fractions=dict(zip(SPLITS, fractions, strict=True)), files=files)


def load_split(
    manifest: Manifest, split: str, root: Path | None = None, strict: bool = True
) -> list[tuple[str, str]]:
    """``(relative path, text)`` for every file of ``split``, verified against the manifest hashes.

    ``root`` defaults to this interpreter's standard library. A missing or changed file raises
    :class:`CorpusMismatchError` when ``strict``; otherwise it is dropped with a warning.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    root = Path(root) if root is not None else stdlib_dir()
    out, bad = [], []
    for entry in manifest.files[split]:
        path = root / entry["path"]
        if not path.is_file():
            bad.append(f"missing {entry['path']}")
            continue
        data = path.read_bytes()
        if _sha256(data) != entry["sha256"]:
            bad.append(f"changed {entry['path']}")
            continue
        out.append((entry["path"], data.decode("utf-8", errors="replace")))
    if bad:
        msg = (f"{len(bad)} of {len(manifest.files[split])} {split} files under {root} differ from the "
               f"manifest (built with Python {manifest.python_version.split()[0]}, this is "
               f"{sys.version.split()[0]}): {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
        if strict:
            raise CorpusMismatchError(msg + ". Pass strict=False to keep only the matching files.")
        warnings.warn(msg + "; using the matching files only.", stacklevel=2)
    return out


def split_jsonl(spec: str, out_dir: Path, chunk_chars: int = 2000) -> Path:
    """'stdlib:MANIFEST#SPLIT' -> a jsonl of {"text"} chunks (whole lines, about ``chunk_chars`` each) of
    that split of the standard-library corpus (this module, files checked against the manifest);
    written once under ``out_dir``. Chunks of about 3 * max_length characters keep most of the text
    within max_length tokens (a 1024-entry BPE averages about 3 characters per token on Python)."""
    manifest_path, _, split = spec.removeprefix("stdlib:").partition("#")
    split = split or "train"
    manifest = Manifest.load(manifest_path)
    out = out_dir / f"stdlib-{split}-{chunk_chars}.jsonl"
    if out.is_file():
        return out
    rows = []
    for _, text in load_split(manifest, split):
        chunk: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            chunk.append(line)
            size += len(line)
            if size >= chunk_chars:
                rows.append("".join(chunk))
                chunk, size = [], 0
        if "".join(chunk).strip():
            rows.append("".join(chunk))
    return write_text(out, "".join(json.dumps({"text": r}) + "\n" for r in rows))
