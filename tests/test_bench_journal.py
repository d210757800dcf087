"""Resuming an interrupted bench (eagle_tree.bench.journal): finished blocks are read back exactly and
never run again, a torn last line is skipped, a changed config measures afresh, and a run stopped by
max_minutes continues from where it stopped to the same report as one uninterrupted run."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from eagle_tree.bench.journal import JOURNAL_FILE, Journal
from eagle_tree.bench.runner import BenchModels
from eagle_tree.bench.timing import Stopped, Timed, interleave
from eagle_tree.commands.bench import STOPPED, main
from eagle_tree.data.tiny import build_tiny_assets
from eagle_tree.decoding.decoder import GenerateOutput
from eagle_tree.decoding.rounds import RoundStats

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "bench-smoke.yaml"


def _calls_of(ran: list):
    return {name: (lambda b, name=name: ran.append((name, b)) or b * 10) for name in ("a", "b")}


def test_interleave_skips_done_blocks_and_reports_each_new_one():
    ran, seen = [], []
    done = {1: {"a": Timed("a", 1, -1, 0.5), "b": Timed("b", 1, -2, 0.5)}}
    out = interleave(_calls_of(ran), 3, warmup=[0], done=done, on_block=lambda b, calls: seen.append((b, set(calls))))
    assert [t.value for t in out["a"]] == [0, -1, 20] and [t.value for t in out["b"]] == [0, -2, 20]
    assert sorted(b for _, b in ran) == [0, 0, 0, 0, 2, 2]  # warm-up on block 0, then blocks 0 and 2
    assert seen == [(0, {"a", "b"}), (2, {"a", "b"})]
    ran.clear()  # the negative control: without done, block 1 runs too
    interleave(_calls_of(ran), 3, warmup=[0])
    assert sorted(b for _, b in ran) == [0, 0, 0, 0, 1, 1, 2, 2]


def test_interleave_stops_between_blocks_and_skips_warmup_when_all_are_done():
    ran, checks = [], []
    with pytest.raises(Stopped) as info:
        interleave(_calls_of(ran), 4, warmup=[0], stop=lambda: checks.append(1) or len(checks) > 2)
    assert (info.value.done, info.value.blocks) == (2, 4) and sorted(b for _, b in ran) == [0, 0, 0, 0, 1, 1]
    ran.clear()
    done = {b: {"a": Timed("a", b, b, 0.1), "b": Timed("b", b, b, 0.1)} for b in range(2)}
    interleave(_calls_of(ran), 2, warmup=[0], done=done, stop=lambda: True)
    assert ran == []  # nothing left: no warm-up, and stop is not asked


def _output(prompt: torch.Tensor, new: list[int]) -> GenerateOutput:
    return GenerateOutput(torch.cat([prompt[None], torch.tensor([new])], dim=1), prompt.shape[0],
                          [RoundStats(2, 3, 5, 0.01, 0.02, 0.001)], 0.1, 0.4, [0.1, 0.2, 0.3, 0.4], "eos")


def test_journal_round_trip_other_keys_and_a_torn_line(tmp_path):
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    journal = Journal(tmp_path / JOURNAL_FILE)
    calls = {"m": Timed("m", 1, _output(prompts[1], [1, 2, 3, 4]), 0.42, 123)}
    journal.append("k1", 1, calls, sitting=0)
    journal.append("k2", 0, {"m": Timed("m", 0, _output(prompts[0], [4]), 0.1, 0)}, sitting=0)
    with open(journal.path, "a") as f:
        f.write('{"key": "k1", "block": 0, "calls": {"m": {"seconds"')  # a kill in the middle of a line
    journal.append("k1", 3, {"m": Timed("m", 3, _output(prompts[1], [7]), 0.2, 0)}, sitting=1)
    done, sittings = journal.load("k1", prompts, ["m"])
    # k2's line and the torn line are skipped; the line after the tear is read
    assert sorted(done) == [1, 3] and sittings == {0, 1}
    back, original = done[1]["m"], calls["m"]
    assert (back.seconds, back.peak_bytes, back.block) == (0.42, 123, 1)
    assert torch.equal(back.value.sequences, original.value.sequences)
    assert back.value.rounds == original.value.rounds and back.value.token_times == original.value.token_times
    assert (back.value.prefill_s, back.value.total_s, back.value.stopped_by) == (0.1, 0.4, "eos")
    assert journal.load("k1", prompts, ["m", "other"]) == ({}, set())  # another method list is another phase
    assert journal.sittings() == 2


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_tiny_assets(tmp_path_factory.mktemp("journal") / "assets")


def _bench(assets, out, *extra):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["--config", str(SMOKE), f"tiny_assets={assets['target'].parent}", f"output_dir={out}",
                   "test_limit=2", "tuning_limit=2", "max_new_tokens=12", "repeats=1", "chain_lengths=[2]",
                   "trees=[{depth: 3, top_k: 2, total_tokens: 6}]", "methods=[plain, hf_generate, chain, tree]",
                   *extra])
    return rc, printed.getvalue()


@pytest.mark.slow
def test_a_stopped_bench_continues_where_it_stopped(assets, tmp_path, monkeypatch):
    import eagle_tree.commands.bench as bench

    real = bench._resume
    checks = []

    def stop_in_the_test_phase(cfg, models, out_dir):
        resume = real(cfg, models, out_dir)
        resume.stop = lambda: checks.append(1) or len(checks) > 3  # tuning's 2 blocks, then 1 test block
        return resume

    out = tmp_path / "out"
    monkeypatch.setattr(bench, "_resume", stop_in_the_test_phase)
    rc, printed = _bench(assets, out)
    assert rc == STOPPED and "run the same command again to continue" in printed
    assert not (out / "bench.json").exists() and (out / JOURNAL_FILE).is_file()
    monkeypatch.setattr(bench, "_resume", real)

    calls = []
    run = BenchModels.run
    monkeypatch.setattr(BenchModels, "run", lambda self, m, *a: calls.append(m.name) or run(self, m, *a))
    rc, printed = _bench(assets, out)
    assert rc == 0 and "tuning: 2 of 2 blocks read back" in printed and "test: 1 of 2 blocks read back" in printed
    report = json.loads((out / "bench.json").read_text())
    methods = [r["method"] for r in report["methods"]]
    assert len(methods) == 4  # plain, hf_generate, the chain and the tree
    assert len(calls) == 2 * len(methods)  # warm-up on the first prompt, then the one missing test block
    assert report["sittings"] == {"count": 2, "blocks_read_back": {"tuning": 2, "test": 1}}
    test = [c for c in report["schedule"] if c["phase"] == "test"]
    assert [c.get("resumed", False) for c in test] == [True] * 4 + [False] * 4
    assert all(r["outputs_match_plain"] is True and r["prompts"] == 2 for r in report["methods"])
    assert "Measured in 2 sittings" in (out / "bench.md").read_text()
    assert not (out / JOURNAL_FILE).exists()  # complete: a rerun measures again

    calls.clear()  # the negative control: a complete run leaves nothing to read back
    rc, printed = _bench(assets, out)
    assert rc == 0 and "blocks read back" not in printed
    assert json.loads((out / "bench.json").read_text())["sittings"]["count"] == 1


def _stopping(monkeypatch, when):
    """Make the bench's journal stop a run when ``when(journal_lines)`` says so."""
    import eagle_tree.commands.bench as bench

    real = bench._resume

    def resume_with_stop(cfg, models, out_dir):
        resume = real(cfg, models, out_dir)
        path = resume.journal.path
        resume.stop = lambda: when(len(path.read_text().splitlines()) if path.is_file() else 0)
        return resume

    monkeypatch.setattr(bench, "_resume", resume_with_stop)


@pytest.mark.slow
def test_a_changed_config_or_resume_false_measures_afresh(assets, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _stopping(monkeypatch, lambda lines: lines >= 2)
    assert _bench(assets, out)[0] == STOPPED  # the 2 tuning blocks are journalled
    _stopping(monkeypatch, lambda lines: True)
    rc, printed = _bench(assets, out)
    assert rc == STOPPED and "tuning: 2 of 2 blocks read back" in printed  # the control: same config resumes
    rc, printed = _bench(assets, out, "max_new_tokens=10")
    assert rc == STOPPED and "blocks read back" not in printed  # another budget is another key
    rc, printed = _bench(assets, out, "resume=false")
    assert rc == STOPPED and "blocks read back" not in printed and not (out / JOURNAL_FILE).exists()
    with pytest.raises(SystemExit) as refused:  # a negative limit is refused before anything runs
        _bench(assets, tmp_path / "fresh", "max_minutes=-1")
    assert refused.value.code == 2 and not (tmp_path / "fresh").exists()
