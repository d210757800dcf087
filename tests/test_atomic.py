"""Atomic writes (eagle_tree/utils/atomic.py) and the head shipper that uses them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_tree.utils.atomic import atomic_dir, atomic_file, write_text

ROOT = Path(__file__).resolve().parents[1]


def _mode(p: Path) -> int:
    return p.stat().st_mode & 0o777


def test_atomic_file_replaces_whole_and_keeps_the_old_file_on_error(tmp_path):
    target = tmp_path / "a.txt"
    write_text(target, "old")
    with pytest.raises(RuntimeError), atomic_file(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]  # no temporary left behind
    write_text(target, "new")
    assert target.read_text() == "new" and _mode(target) == 0o644


def test_atomic_dir_makes_owner_only_files_readable(tmp_path):
    dst = tmp_path / "head"
    with atomic_dir(dst) as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))  # safetensors writes 0600
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "x").write_text("x")
        (tmp / "sub" / "x").chmod(0o600)
        (tmp / "private").write_text("p")
        (tmp / "private").chmod(0o640)  # a mode set on purpose is kept
    assert _mode(dst) == 0o755 and _mode(dst / "sub") == 0o755
    assert _mode(dst / "model.safetensors") == 0o644 and _mode(dst / "sub" / "x") == 0o644
    assert _mode(dst / "private") == 0o640


def test_atomic_dir_keeps_the_old_folder_on_error(tmp_path):
    dst = tmp_path / "head"
    with atomic_dir(dst) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(dst) as tmp:
        (tmp / "a").write_text("new")
        raise RuntimeError("interrupted")
    assert (dst / "a").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["head"]


def _head(folder: Path, rows: int) -> None:
    folder.mkdir(parents=True)
    save_file({"w": torch.randn(rows, 4), "d2t": torch.arange(3)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")


def _ship(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train/ship_head.py"), *args], capture_output=True, text=True,
                          cwd=ROOT)


def test_ship_head_rounds_keeps_decoding_defaults_and_refuses_oversize_without_touching_dst(tmp_path):
    src, dst = tmp_path / "final", tmp_path / "ship"
    _head(src, 8)
    dst.mkdir()
    (dst / "decoding.json").write_text('{"kept": true}')
    r = _ship(f"src={src}", f"dst={dst}", "run_dir=null")
    assert r.returncode == 0, r.stderr
    state = load_file(dst / "model.safetensors")
    assert state["w"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.int64  # maps stay integers
    assert json.loads((dst / "decoding.json").read_text()) == {"kept": True}
    assert _mode(dst / "model.safetensors") == 0o644
    before = (dst / "model.safetensors").read_bytes()
    big = tmp_path / "big"
    _head(big, 7 * 2**19)  # 14.7M floats: 29 MB in bfloat16, over the 25 MiB limit
    r = _ship(f"src={big}", f"dst={dst}", "run_dir=null")
    assert r.returncode == 2 and "over 25 MB" in r.stderr
    assert (dst / "model.safetensors").read_bytes() == before  # the shipped head is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "final", "ship"]
