"""The interleaved timing harness (eagle_tree.bench.timing) every benchmark runs through."""

from __future__ import annotations

import time

import pytest

from eagle_tree.bench.timing import interleave, repeat_seconds, rotated, rotation


def test_rotation_puts_each_method_first_once_per_cycle():
    orders = [rotation(3, b) for b in range(3)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert sorted(o[0] for o in orders) == [0, 1, 2]
    assert sorted(o[-1] for o in orders) == [0, 1, 2]
    assert rotation(0, 5) == []
    assert rotated("abc", 4) == ["b", "c", "a"]


def test_interleave_runs_every_method_once_per_block_in_rotated_order():
    seen = []
    calls = {name: (lambda b, name=name: seen.append((b, name)) or f"{name}{b}") for name in "xyz"}
    runs = interleave(calls, 4, offset=1, warmup=[0])
    warm, timed = seen[:3], seen[3:]
    assert warm == [(0, "x"), (0, "y"), (0, "z")]  # warm-up: untimed, not returned
    assert timed[:3] == [(0, "y"), (0, "z"), (0, "x")]  # block 0 rotated by the offset
    assert timed[3:6] == [(1, "z"), (1, "x"), (1, "y")]
    assert list(runs) == ["x", "y", "z"]
    for name, done in runs.items():
        assert [t.block for t in done] == [0, 1, 2, 3]
        assert [t.value for t in done] == [f"{name}{b}" for b in range(4)]
        assert all(t.method == name and t.seconds >= 0 and t.peak_bytes == 0 for t in done)
    # negative control: without the rotation the same method would lead every block
    assert {timed[3 * b][1] for b in range(4)} == {"x", "y", "z"}


def test_interleave_times_the_call_itself():
    runs = interleave({"slow": lambda b: time.sleep(0.02), "fast": lambda b: None}, 2)
    assert min(t.seconds for t in runs["slow"]) >= 0.02
    assert max(t.seconds for t in runs["fast"]) < min(t.seconds for t in runs["slow"])


def test_interleave_measures_peak_memory_when_asked():
    import torch

    runs = interleave({"big": lambda b: torch.ones(8 * 2**20).sum(), "none": lambda b: 0}, 1, memory=True)
    assert runs["big"][0].peak_bytes >= 16 * 2**20  # 32 MB of float32 touched
    assert runs["none"][0].peak_bytes < runs["big"][0].peak_bytes


def test_interleave_logs_each_timed_call_and_rejects_negative_blocks():
    logged = []
    interleave({"a": lambda b: b, "b": lambda b: b}, 2, log=logged.append)
    assert [(t.block, t.method) for t in logged] == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]
    with pytest.raises(ValueError, match="blocks"):
        interleave({"a": lambda b: b}, -1)


def test_repeat_seconds_skips_warmup_calls():
    n = []
    times = repeat_seconds(lambda: n.append(1), 5, warmup=3)
    assert len(times) == 5 and len(n) == 8
