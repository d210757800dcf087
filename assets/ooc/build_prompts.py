"""Build the out-of-corpus prompt set (assets/ooc): spans of this project's own source files and docs,
which neither the reference corpus (the Python standard library) nor the regenerated training data
(the target's continuations of corpus text) contains. Run once from the repository root; the files
are kept fixed afterwards:

    python assets/ooc/build_prompts.py

Files (eagle_tree/**/*.py, docs/*.md, README.md at the commit in assets/ooc/build.json) are split by
a seeded shuffle into test and tuning files, so the two sets share no file; spans are whole lines of
128 to 256 tokens of the reference tokenizer, extracted like the reference prompts.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

from transformers import AutoTokenizer

from eagle_tree.reference.builder import extract_prompts

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "assets" / "ooc"


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets" / "reference" / "target")
    paths = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("eagle_tree/**/*.py"), *ROOT.glob("docs/*.md"),
                                                       ROOT / "README.md"])
    files = [(p, (ROOT / p).read_text()) for p in paths if len((ROOT / p).read_text()) > 2000]
    random.Random(0).shuffle(files)
    half = len(files) // 2
    test = extract_prompts(tokenizer, files[:half], n=16, seed=0, prefix="ooc-test-")
    tuning = extract_prompts(tokenizer, files[half:], n=8, seed=1, prefix="ooc-tuning-")
    for name, rows in (("prompts.jsonl", test), ("tuning.jsonl", tuning)):
        (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    build = {"commit": commit, "test_files": sorted(p for p, _ in files[:half]),
             "tuning_files": sorted(p for p, _ in files[half:]), "test": len(test), "tuning": len(tuning)}
    (OUT / "build.json").write_text(json.dumps(build, indent=1) + "\n")


if __name__ == "__main__":
    main()
