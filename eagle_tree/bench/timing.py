"""The one interleaved timing harness of every benchmark (docs/MEASURING.md, "Interleaving").

Methods compared on one machine must see the same machine: a background job, a thermal dip or a
cache warmed by the previous call must not fall on one method only. So every benchmark in the project
(the bench, the MT-bench section, the serving sweep, the quickstart and the recipes in ``decode/``)
runs its methods through :func:`interleave`: the work is cut into *blocks* (a prompt, a repeat of a
batch, an arrival rate), every method runs once per block, and the order inside block b is rotated by
``offset + b`` places (:func:`rotation`), so no method always runs first or last. Each call is timed
with a wall clock (synchronised on a GPU) and, when asked, its peak memory.

:func:`repeat_seconds` is the single-function form: one callable, untimed warm-up calls, then the
wall time of each timed call (the kernel and verifier micro-benchmarks take its median).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from eagle_tree.bench.memory import PeakMemory

T = TypeVar("T")


def rotation(n: int, shift: int) -> list[int]:
    """Indices 0..n-1 rotated left by ``shift`` places: the order of the methods in one block."""
    return [(shift + j) % n for j in range(n)] if n > 0 else []


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """``items`` in the order :func:`rotation` gives."""
    return [items[i] for i in rotation(len(items), shift)]


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the device's queued work (a no-op off CUDA), so a wall clock measures the work itself."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timed(Generic[T]):
    """One timed call: what it returned, its wall time and (when measured) its peak memory."""

    method: str
    block: int
    value: T
    seconds: float
    peak_bytes: int = 0


class Stopped(Exception):
    """:func:`interleave` stopped between blocks because ``stop()`` said so; ``done`` blocks of
    ``blocks`` are finished (and were passed to ``on_block``)."""

    def __init__(self, done: int, blocks: int):
        super().__init__(f"stopped after {done} of {blocks} blocks")
        self.done, self.blocks = done, blocks


def interleave(
    methods: Mapping[str, Callable[[int], T]],
    blocks: int,
    *,
    offset: int = 0,
    warmup: Sequence[int] = (),
    device: torch.device | str | None = None,
    memory: bool = False,
    log: Callable[[Timed], Any] | None = None,
    done: Mapping[int, Mapping[str, Timed[T]]] | None = None,
    on_block: Callable[[int, dict[str, Timed[T]]], Any] | None = None,
    stop: Callable[[], bool] | None = None,
) -> dict[str, list[Timed[T]]]:
    """Run ``methods[name](block)`` for every block 0..blocks-1 and every method, interleaved.

    First every method runs once on each block of ``warmup`` (untimed, not returned: compilation,
    allocator and cache warm-up), then block b runs the methods in the order ``rotation(n, offset + b)``.
    Returns, per method in ``methods``' order, its :class:`Timed` calls in block order. ``memory``
    measures each call's peak memory above its start (eagle_tree.bench.memory); ``log`` sees each
    timed call as it ends.

    Resuming (eagle_tree.bench.journal): blocks in ``done`` (block -> method -> call, from an earlier
    run) are returned as they are and not run again; ``on_block(b, calls)`` sees each block that ran as
    soon as its last method returns; ``stop()`` is asked before each block that would run, and when it
    says so :class:`Stopped` is raised (warm-up is skipped when nothing is left to run)."""
    if blocks < 0:
        raise ValueError(f"blocks must be >= 0, got {blocks}")
    names = list(methods)
    done = done or {}
    finished = sum(1 for b in range(blocks) if b in done)
    if finished < blocks:
        for b in warmup:
            for name in names:
                methods[name](b)
    synchronize(device)
    out: dict[str, list[Timed[T]]] = {name: [] for name in names}
    for b in range(blocks):
        if b in done:
            for name in names:
                out[name].append(done[b][name])
            continue
        if stop is not None and stop():
            raise Stopped(finished, blocks)
        calls: dict[str, Timed[T]] = {}
        for name in rotated(names, offset + b):
            peak = 0
            if memory:
                with PeakMemory(device if device is not None else "cpu") as mem:
                    value, seconds = _timed(methods[name], b, device)
                peak = mem.peak_bytes
            else:
                value, seconds = _timed(methods[name], b, device)
            call = Timed(name, b, value, seconds, peak)
            out[name].append(call)
            calls[name] = call
            if log is not None:
                log(call)
        finished += 1
        if on_block is not None:
            on_block(b, calls)
    return out


def repeat_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 2,
                   device: torch.device | str | None = None) -> list[float]:
    """Wall seconds of each of ``repeats`` calls of ``fn()`` after ``warmup`` untimed ones."""
    runs = interleave({"fn": lambda _b: fn()}, repeats, warmup=[0] * warmup, device=device)
    return [t.seconds for t in runs["fn"]]


def _timed(fn: Callable[[int], T], block: int, device) -> tuple[T, float]:
    t0 = time.perf_counter()
    value = fn(block)
    synchronize(device)
    return value, time.perf_counter() - t0
