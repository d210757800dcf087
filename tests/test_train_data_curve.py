"""train/data_curve.py: held-out agreement against training conversations, its log-linear trend and projection."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers import load_script


def _module():
    return load_script("train/data_curve.py")


def _report(path: Path, agreement: list[float], chain: float, prompts: str = "p.jsonl") -> str:
    path.write_text(json.dumps({"prompts": prompts, "num_prompts": 54, "acceptance_length_chain": chain,
                                "acceptance_length_tree": chain + 0.5, "agreement_per_step": agreement}))
    return str(path)


def test_exact_line_recovered_and_projected(tmp_path, capsys):
    mod = _module()
    # agreement_0 = 0.2 + 0.03 * log2(n): the fit must give slope 0.03 and reach 0.5 at n = 2**10
    specs = [f"{n}=" + _report(tmp_path / f"h{n}.json", [0.2 + 0.03 * math.log2(n), 0.1], 1.0 + 0.1 * math.log2(n))
             for n in (64, 256, 512)]
    out = tmp_path / "curve.png"
    assert mod.main([*specs, "--target", "0.5", "--out", str(out)]) == 0
    result = mod.analyse(mod.read_points(specs), 0.5)
    assert result["fits"]["agreement_0"]["per_doubling"] == pytest.approx(0.03)
    assert result["fits"]["chain"]["per_doubling"] == pytest.approx(0.1)
    assert result["conversations_at_target"] == pytest.approx(1024, rel=1e-6)
    assert out.stat().st_size > 5000
    printed = capsys.readouterr().out
    assert "| 512 |" in printed and "about 1,024 conversations (2x the largest point)" in printed


def test_falling_trend_never_reaches_target(tmp_path):
    mod = _module()
    specs = [f"{n}=" + _report(tmp_path / f"h{n}.json", [0.6 - 0.01 * i], 1.5) for i, n in enumerate((100, 200))]
    assert mod.analyse(mod.read_points(specs), 0.75)["conversations_at_target"] is None


def test_bad_inputs_are_refused(tmp_path):
    mod = _module()
    a = _report(tmp_path / "a.json", [0.5], 1.5)
    b = _report(tmp_path / "b.json", [0.55], 1.6, prompts="other.jsonl")
    with pytest.raises(SystemExit, match="different prompts"):
        mod.read_points([f"100={a}", f"200={b}"])
    with pytest.raises(SystemExit, match="CONVERSATIONS=REPORT"):
        mod.read_points([a])
    with pytest.raises(SystemExit, match="at least two data sizes"):
        mod.read_points([f"100={a}"])
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(SystemExit, match="not a decode/head_report.py output"):
        mod.read_points([f"100={tmp_path / 'x.json'}"])
