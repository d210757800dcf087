"""train/ship_rule.py: a candidate head judged against the bar by a fixed rule, every figure named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import load_script


def _report(path: Path, tree: float, chain: float, agreement: list[float], **extra) -> str:
    body = {"prompts": "p.jsonl", "num_prompts": 84, "max_new_tokens": 64, "chain": "chain-4",
            "tree": "tree-d5k4n16", "acceptance_length_tree": tree, "acceptance_length_chain": chain,
            "agreement_per_step": agreement, **extra}
    path.write_text(json.dumps(body))
    return str(path)


BAR = (2.2536, 1.7244, [0.5289, 0.4624, 0.4329, 0.3750])


def test_ships_when_one_gain_rises_and_nothing_falls(tmp_path, capsys):
    mod = load_script("train/ship_rule.py")
    bar = _report(tmp_path / "bar.json", *BAR)
    cand = _report(tmp_path / "c.json", 2.2536, 1.7310, [0.5300, 0.4610, 0.4329, 0.3750])
    assert mod.main([cand, bar]) == 0
    out = capsys.readouterr().out
    assert "| chain | 1.7244 | 1.7310 | +0.0066 | 0.005 | rises |" in out
    assert "| agreement_1 | 0.4624 | 0.4610 | -0.0014 | 0.002 | level |" in out
    assert out.strip().endswith("ships: nothing falls beyond its tolerance; rises: chain")


def test_a_fall_at_a_later_step_blocks_a_rise_in_the_tree(tmp_path, capsys):
    # negative control for the fifteenth run's pass: the tree rose, but step 1 fell beyond tolerance
    mod = load_script("train/ship_rule.py")
    bar = _report(tmp_path / "bar.json", *BAR)
    cand = _report(tmp_path / "c.json", 2.2700, 1.7244, [0.5289, 0.4590, 0.4329, 0.3750])
    assert mod.main([cand, bar]) == 1
    out = capsys.readouterr().out
    assert "does not ship (falls: agreement_1)" in out
    # the same candidate ships if step 1 is not judged: the rule reads the steps it is given
    assert mod.main([cand, bar, "--steps", "1"]) == 0


def test_all_level_does_not_ship(tmp_path, capsys):
    mod = load_script("train/ship_rule.py")
    bar = _report(tmp_path / "bar.json", *BAR)
    assert mod.main([bar, bar]) == 1
    assert "none of tree,chain,agreement_0 rises" in capsys.readouterr().out
    # a rise outside the gain figures (step 3) is not enough
    cand = _report(tmp_path / "c.json", BAR[0], BAR[1], [0.5289, 0.4624, 0.4329, 0.3900])
    assert mod.main([cand, bar]) == 1


def test_bad_inputs_are_refused(tmp_path):
    mod = load_script("train/ship_rule.py")
    bar = _report(tmp_path / "bar.json", *BAR)
    other = _report(tmp_path / "o.json", *BAR, max_new_tokens=128)
    with pytest.raises(SystemExit, match="differ in max_new_tokens"):
        mod.main([other, bar])
    with pytest.raises(SystemExit, match="--steps"):
        mod.main([bar, bar, "--steps", "6"])
    with pytest.raises(SystemExit, match="--gain names"):
        mod.main([bar, bar, "--gain", "speed"])
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(SystemExit, match="not a decode/head_report.py output"):
        mod.main([str(tmp_path / "x.json"), bar])
