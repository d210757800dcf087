"""The specification documents in docs/ are real: every document a file refers to exists in the
repository, every quoted section exists in its document, every test that docs/EXACTNESS.md cites
exists, and the level table of docs/ARCHITECTURE.md is the one tests/test_layout.py enforces."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "results", "runs", "wandb", "__pycache__", ".pytest_cache", ".ruff_cache"}

DOC_NAME = re.compile(r"(?<![\w/.-])([A-Z][A-Z0-9_-]+\.md)\b")  # README.md, EXACTNESS.md, ...
DOC_PATH = re.compile(r"(?<![\w/.-])(docs/[\w./-]+?\.md)\b")  # docs/TRAINING.md, docs/x/y.md
# a document followed by a quoted section name: docs/X.md, "Section" / X.md ("Section") / `X.md`, "Section"
SECTION_REF = re.compile(r"((?:docs/)?[A-Z][A-Z0-9_-]+\.md)`?\)?,?\s+\(?\"([^\"]+)\"")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTSIDE = ("../" + "shared", "shared/" + "design", "seed-" + "article")  # split, so this file holds none


def repo_files() -> list[Path]:
    """Files of the repository: tracked and untracked-but-not-ignored ones (a plain walk without git)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
        names = [n for n in out.decode().split("\0") if n]
        return sorted(p for p in (ROOT / n for n in names) if p.is_file())
    except (OSError, subprocess.SubprocessError):
        files = []
        for p in ROOT.rglob("*"):
            rel = p.relative_to(ROOT)
            if p.is_file() and not SKIP_DIRS & set(rel.parts):
                files.append(p)
        return sorted(files)


def text_files() -> dict[Path, str]:
    texts = {}
    for p in repo_files():
        if p.stat().st_size > 2_000_000:
            continue
        try:
            texts[p] = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (weights, images)
    texts.pop(Path(__file__).resolve(), None)  # this file's examples name missing documents on purpose
    return texts


FILES = repo_files()
TEXTS = text_files()
BY_NAME: dict[str, list[Path]] = {}
for _p in FILES:
    BY_NAME.setdefault(_p.name, []).append(_p)


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def resolve_doc(ref: str) -> Path | None:
    """docs/X.md relative to the repository root; a bare X.md by its file name anywhere in it."""
    if "/" in ref:
        p = ROOT / ref
        return p if p.is_file() else None
    found = BY_NAME.get(ref, [])
    return found[0] if found else None


def headings(doc: Path) -> list[str]:
    return [_norm(line.lstrip("#")) for line in doc.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


def _norm(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def test_the_specification_documents_exist():
    for name in ("ARCHITECTURE.md", "EXACTNESS.md", "MEASURING.md"):
        assert (ROOT / "docs" / name).is_file(), f"docs/{name} is missing"


def test_every_referenced_document_exists():
    missing = []
    for path, text in TEXTS.items():
        for pattern in (DOC_NAME, DOC_PATH):
            for m in pattern.finditer(text):
                if resolve_doc(m.group(1)) is None:
                    line = text.count("\n", 0, m.start()) + 1
                    missing.append(f"{rel(path)}:{line}: {m.group(1)}")
    assert not missing, "references to documents that are not in the repository:\n" + "\n".join(missing)


def test_quoted_sections_exist():
    """``docs/X.md, "Section"`` must name a heading of X.md (a prefix of it is enough)."""
    bad = []
    for path, text in TEXTS.items():
        for m in SECTION_REF.finditer(text):
            doc = resolve_doc(m.group(1))
            if doc is None:
                continue  # reported by test_every_referenced_document_exists
            section = _norm(m.group(2))
            if not any(h.startswith(section) for h in headings(doc)):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{rel(path)}:{line}: {m.group(1)} has no section {section!r}")
    assert not bad, "\n".join(bad)


def test_markdown_links_resolve():
    bad = []
    for path, text in TEXTS.items():
        if path.suffix != ".md":
            continue
        for m in MD_LINK.finditer(text):
            target = m.group(1).split("#")[0]
            if not target or re.match(r"^[a-z]+:", target):
                continue  # a URL or an anchor
            if not (path.parent / target).exists():
                bad.append(f"{rel(path)}: link to {m.group(1)}")
    assert not bad, "\n".join(bad)


def test_nothing_points_outside_the_repository():
    bad = [f"{rel(p)}: {s}" for p, text in TEXTS.items() for s in OUTSIDE if s in text]
    assert not bad, "references to files outside the repository:\n" + "\n".join(bad)


def test_the_checks_see_a_missing_document():
    """Negative control: the patterns catch both forms of reference, and a missing file is missing."""
    text = 'see NO-SUCH-DOC.md and docs/NOWHERE.md, and docs/EXACTNESS.md, "No such section"'
    refs = [m.group(1) for pattern in (DOC_NAME, DOC_PATH) for m in pattern.finditer(text)]
    assert refs == ["NO-SUCH-DOC.md", "docs/NOWHERE.md", "docs/EXACTNESS.md"]
    assert [resolve_doc(r) is None for r in refs] == [True, True, False]
    (ref, section), = [m.groups() for m in SECTION_REF.finditer(text)]
    assert ref == "docs/EXACTNESS.md" and not any(h.startswith(section) for h in headings(ROOT / ref))


# ------------------------------------------------------------------------------- tests cited in EXACTNESS.md

EXACTNESS = ROOT / "docs" / "EXACTNESS.md"
CITED = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
BARE_TEST = re.compile(r"(?<![\w/:.])(test_\w+)\b(?!\.py)")


def defined_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_tests_cited_in_exactness_exist():
    text = EXACTNESS.read_text(encoding="utf-8")
    cited = CITED.findall(text)
    assert len(cited) >= 40, "docs/EXACTNESS.md should map its claims to tests as tests/FILE.py::NAME"
    missing = [f"{f}::{name}" for f, name in cited
               if not (ROOT / f).is_file() or name not in defined_functions(ROOT / f)]
    every_test = set().union(*(defined_functions(p) for p in (ROOT / "tests").glob("*.py")))
    missing += [name for name in BARE_TEST.findall(text) if name not in every_test]
    assert not missing, "docs/EXACTNESS.md cites tests that do not exist:\n" + "\n".join(missing)


def test_exactness_cites_the_negative_controls():
    """Every known wrong rule of the exact reference is named in docs/EXACTNESS.md."""
    from tests.exact_reference import NEGATIVE_CONTROLS

    text = EXACTNESS.read_text(encoding="utf-8").lower()
    words = {"fresh_p_after_rejection": "fresh sample from `p`", "draft_softmax_as_q": "draft softmax",
             "reused_draft_noise": "reused draft noise", "sorted_children": "sorted children",
             "skip_duplicates": "skipped duplicates", "bonus_from_raw": "bonus from raw logits",
             "decision_per_path": "one decision per path", "unremoved_siblings": "unremoved siblings"}
    assert set(words) == set(NEGATIVE_CONTROLS), "a new negative control needs its words here and in the document"
    assert [c for c, w in words.items() if w not in text] == []


# ------------------------------------------------------------------------------- import levels of ARCHITECTURE.md

LEVEL_ROW = re.compile(r"^\| `(\w+)/` \| (\d+) \|", re.M)


def test_architecture_levels_are_the_ones_test_layout_checks():
    """The level table of docs/ARCHITECTURE.md is the one tests/test_layout.py enforces on the imports."""
    from tests.test_layout import LEVELS

    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    documented = {folder: int(level) for folder, level in LEVEL_ROW.findall(text)}
    folders = {k: v for k, v in LEVELS.items() if (ROOT / "eagle_tree" / k).is_dir()}
    assert documented == folders
