"""The device check (scripts/gpu_check.sh) cannot rot: its CPU rehearsal runs here on tiny models and
what it writes is checked; its pieces (the law check's target and p-value, the comparison rule of
bfloat16 outputs, a failing section) are checked on their own."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle_tree.bench import law
from eagle_tree.commands import gpu_check
from eagle_tree.core.sampling import SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
TIMING_SUFFIXES = ("_ms", "_s", "tokens_per_s")


def timings(tree, path=""):
    """(path, value) of every timing in a report: keys ending in _ms, _s or tokens_per_s."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k.endswith(TIMING_SUFFIXES) and not isinstance(v, dict | list):
                yield f"{path}.{k}", v
            else:
                yield from timings(v, f"{path}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from timings(v, f"{path}[{i}]")


@pytest.mark.slow
def test_the_cpu_rehearsal_writes_every_section_with_true_verdicts_and_finite_timings(tmp_path):
    out = tmp_path / "check"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--small", "--threads",
                           "1", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "device check: PASSED" in proc.stdout

    report = json.loads((out / "gpu_check.json").read_text())
    assert report["format"] == gpu_check.FORMAT and report["ok"] is True
    assert report["conditions"]["device"] == "cpu" and report["conditions"]["small"] is True
    sections = report["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)
    assert all(s["ok"] is True and "error" not in s and "skipped" not in s for s in sections.values())

    ex = sections["exactness"]
    for key in ("reference_float32", "reference_bfloat16"):
        assert ex[key]["ok"] and ex[key]["probabilities_float32"] and ex[key]["accepted_drafts"]
        assert set(ex[key]["cases"]) == {*gpu_check.EXACT_SHAPES, f"batch-{gpu_check.BATCH}-tree-d6k8n48"}
        assert all(c["ok"] and c["calls"] == 4 for c in ex[key]["cases"].values())
    assert set(ex["law_t1"]["cases"]) == set(gpu_check.LAW_CASES)
    assert all(c["ok"] and c["p_x1_x2"] > law.LAW_ALPHA for c in ex["law_t1"]["cases"].values())

    split = sections["round_split"]
    assert {"reference", *gpu_check.SIZES[True]["targets"]} <= set(split)
    for name in ("reference", *gpu_check.SIZES[True]["targets"]):
        r = split[name]
        assert [v["k"] for v in r["verify"]][:2] == [1, 2] and r["verify"][-1]["k"] == 64
        assert set(r["methods"]) == {"plain", "chain-4", "tree-d6k8n48"}
        assert r["head_forward_ms"] > 0 and r["hf_generate"]["ms_per_token"] > 0
        assert all(0 <= m["other_share"] < 1 and m["tokens_per_round"] >= 1 for m in r["methods"].values())
    assert split["llama-3.1-8b-shape-small"]["target"]["dtype"] == "bfloat16"

    tr = sections["training"]
    assert tr["target"] == "llama-3.1-8b-shape-small" and tr["tokens_per_s"] > 0
    assert len(tr["losses"]) == tr["steps_timed"] and all(math.isfinite(x) for x in tr["losses"])

    found = dict(timings(report))
    assert len(found) > 50
    bad = {k: v for k, v in found.items() if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0)}
    assert not bad
    assert all(v > 0 for k, v in found.items() if k.endswith(("step_ms", "round_ms", "tokens_per_s", "wall_s")))
    assert report["cpu_s"] < 60  # the rehearsal's own CPU time: under a minute on a quiet core

    md = (out / "gpu_check.md").read_text()
    for name in gpu_check.SECTIONS:
        assert f"## {name}: ok" in md
    assert "| k tokens verified |" in md and "Hugging Face generate" in md and "tokens / s" in md


def test_a_failing_section_is_recorded_and_the_next_ones_still_run(tmp_path, monkeypatch):
    def broken(device, size):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(gpu_check, "exactness", broken)
    monkeypatch.setattr(gpu_check, "round_splits", lambda device, size: {"ok": True})
    report = gpu_check.run_check(tmp_path, torch.device("cpu"), True, budget_s=60.0, only=("exactness", "round_split"))
    assert report["ok"] is False and list(report["sections"]) == ["exactness", "round_split"]
    assert report["sections"]["exactness"]["error"] == "RuntimeError: no such kernel"
    assert report["sections"]["round_split"]["ok"]
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["sections"]["exactness"]["ok"] is False
    assert "## exactness: FAILED" in (tmp_path / "gpu_check.md").read_text()
    skipped = gpu_check.run_check(tmp_path / "late", torch.device("cpu"), True, budget_s=-1.0)
    assert all("skipped" in s for s in skipped["sections"].values())


def test_first_difference():
    assert gpu_check.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert gpu_check.first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert gpu_check.first_difference([1, 2], [1, 2, 3]) == 2


def test_the_law_target_is_the_sampling_suites():
    from tests.test_decoder_exactness import SPROMPT, SV, _sampling_target

    assert (law.LAW_VOCAB, law.LAW_PROMPT) == (SV, tuple(SPROMPT))
    ids = torch.tensor([[3, 7, 1, 4, 9]])
    with torch.no_grad():
        ours = law.law_target().model(ids, use_cache=False).logits
        suites = _sampling_target().model(ids, use_cache=False).logits
    assert torch.equal(ours, suites)


def test_chi2_pvalue_matches_scipy_and_rejects_a_biased_sampler():
    from scipy.stats import chi2

    target = law.law_target()
    joint = law.exact_laws(target, SamplingConfig(temperature=1.0))[0]
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(joint.flatten().float(), 1000, replacement=True, generator=g)
    counts = torch.bincount(draws, minlength=joint.numel()).double()
    p = law.chi2_pvalue(counts, joint)
    expected = joint.flatten() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    assert p == pytest.approx(float(chi2.sf(float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1)), rel=1e-9)
    assert p > law.LAW_ALPHA
    biased = joint.clone().flatten()
    top = biased.topk(2).indices
    biased[top[0]] -= 0.075
    biased[top[1]] += 0.075
    counts = torch.bincount(torch.multinomial(biased.float(), 1000, replacement=True, generator=g),
                            minlength=joint.numel())
    assert law.chi2_pvalue(counts, joint) < law.LAW_ALPHA
    assert law.chi2_pvalue(torch.ones(3), torch.tensor([0.5, 0.5, 0.0])) == 0.0
