"""The standard-library corpus: file discovery, the seeded by-file split, the manifest, a tiny tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle_tree.data import corpus
from eagle_tree.reference import builder as ref


def _fake_stdlib(root: Path, n: int = 40) -> Path:
    for i in range(n):
        pkg = root / ("pkg" if i % 3 == 0 else "") / f"mod_{i}.py"
        pkg.parent.mkdir(parents=True, exist_ok=True)
        pkg.write_text(f"def f_{i}(x):\n    return x + {i}\n\n\nclass C{i}:\n    pass\n")
    for excluded in ["test/test_a.py", "pkg/tests/b.py", "idlelib/c.py", "site-packages/d/e.py",
                     "unittest/test/f.py", "test_top.py", "lib2to3/g.py"]:
        (root / excluded).parent.mkdir(parents=True, exist_ok=True)
        (root / excluded).write_text("x = 1\n")
    (root / "empty.py").write_text("\n")
    return root


def test_find_source_files_excludes_tests(tmp_path):
    files = [p.as_posix() for p in corpus.find_source_files(_fake_stdlib(tmp_path))]
    assert len(files) == 41  # 40 modules and the empty file
    assert not any("test" in f or "idlelib" in f or "site-packages" in f or "lib2to3" in f for f in files)
    assert files == sorted(files)


def test_real_stdlib_is_found_without_tests():
    files = corpus.find_source_files()
    names = {p.as_posix() for p in files}
    assert "os.py" in names and "json/decoder.py" in names
    assert not any(part in {"test", "tests", "idlelib"} for p in files for part in p.parts)
    assert len(files) > 200


def test_split_is_deterministic_disjoint_and_complete(tmp_path):
    root = _fake_stdlib(tmp_path)
    a = corpus.build_manifest(root, seed=3)
    b = corpus.build_manifest(root, seed=3)
    assert a.files == b.files
    assert corpus.build_manifest(root, seed=4).files != a.files
    sets = {s: set(a.paths(s)) for s in corpus.SPLITS}
    assert not sets["train"] & sets["tuning"] and not sets["train"] & sets["test"]
    assert not sets["tuning"] & sets["test"]
    assert set().union(*sets.values()) == {p.as_posix() for p in corpus.find_source_files(root)} - {"empty.py"}
    assert len(sets["tuning"]) == len(sets["test"]) == 2 and len(sets["train"]) == 36


def test_manifest_round_trips_and_verifies(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    m = corpus.build_manifest(root, seed=0)
    m.save(tmp_path / "manifest.json")
    m2 = corpus.Manifest.load(tmp_path / "manifest.json")
    assert m2.to_json() == m.to_json()
    texts = corpus.load_split(m2, "test", root=root)
    assert [p for p, _ in texts] == m.paths("test")
    assert all(t == (root / p).read_text() for p, t in texts)

    changed = m.paths("test")[0]
    (root / changed).write_text("# edited\n")
    with pytest.raises(corpus.CorpusMismatchError, match="changed"):
        corpus.load_split(m2, "test", root=root)
    with pytest.warns(UserWarning, match="matching files only"):
        kept = corpus.load_split(m2, "test", root=root, strict=False)
    assert [p for p, _ in kept] == m.paths("test")[1:]
    with pytest.raises(ValueError):
        corpus.load_split(m2, "validation", root=root)


def test_tiny_tokenizer_round_trips_and_packs(tmp_path):
    root = _fake_stdlib(tmp_path)
    m = corpus.build_manifest(root)
    texts = [t for _, t in corpus.load_split(m, "train", root=root)]
    tok = ref.train_tokenizer(texts, vocab_size=300)
    assert len(tok) <= 300
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    snippet = "def g(y):\n    return {'k': y ** 2}  # é\n"
    ids = tok(snippet)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == snippet
    stream = ref.encode_files(tok, texts[:3])
    assert (stream == tok.eos_token_id).sum() == 3 and (stream == tok.bos_token_id).sum() == 3
    rows = ref.pack(stream, 16)
    assert all(len(r) == 16 for r in rows) and len(rows) == len(stream) // 16
    assert sum(len(r) for r in ref.pack(stream, 16, keep_remainder=True)) >= len(stream) - 1

    tok.save_pretrained(tmp_path / "tok")
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert again(snippet)["input_ids"] == ids


def test_prompts_are_line_spans_of_their_files(tmp_path):
    root = _fake_stdlib(tmp_path)
    m = corpus.build_manifest(root)
    files = corpus.load_split(m, "train", root=root)
    tok = ref.train_tokenizer([t for _, t in files], vocab_size=300)
    long_files = [(p, t * 20) for p, t in files[:4]]
    prompts = ref.extract_prompts(tok, long_files, n=6, min_tokens=20, max_tokens=40, seed=1, prefix="x-")
    assert len(prompts) == 6 and len({p["id"] for p in prompts}) == 6
    by_path = dict(long_files)
    for p in prompts:
        text = by_path[p["file"]]
        lines = text.splitlines(keepends=True)
        assert p["prompt"] == "".join(lines[p["start_line"] - 1:p["start_line"] - 1 + p["prompt"].count("\n")])
        assert p["prompt"].endswith("\n")
        assert p["n_tokens"] == len(tok(p["prompt"])["input_ids"])
    assert ref.extract_prompts(tok, long_files, n=6, min_tokens=20, max_tokens=40, seed=1, prefix="x-") == prompts
