"""train/curve.py: chained runs on one clock of training hours, the table and the PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import load_script


def _curve():
    return load_script("train/curve.py")


def _summary(path: Path, evals: list[tuple[float, int, float]]) -> Path:
    path.write_text(json.dumps({"evals": [
        {"train_minutes": m, "step": s, "acceptance_length_chain": a, "acceptance_length_tree": a + 0.3,
         "agreement": [a / 4, a / 8]} for m, s, a in evals]}))
    return path


def test_chained_runs_share_one_clock_and_the_plot_is_written(tmp_path, capsys):
    curve = _curve()
    first = _summary(tmp_path / "a.json", [(10, 50, 1.2), (30, 150, 1.5)])
    second = _summary(tmp_path / "b.json", [(15, 60, 1.6), (45, 200, 1.8)])
    rows = curve.points([first, second])
    assert [round(r["hours"], 3) for r in rows] == [round(h / 60, 3) for h in (10, 30, 45, 75)]
    assert [r["run"] for r in rows] == [0, 0, 1, 1]
    out = tmp_path / "curve.png"
    assert curve.main([str(first), str(second), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "| 1 | 1.25 | 200 | 1.80 | 2.10 | 0.450 / 0.225 |" in printed


def test_a_run_without_evaluations_is_named(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"evals": []}))
    with pytest.raises(SystemExit, match="empty.json has no evaluations"):
        _curve().points([empty])
