"""The bench's journal: every finished block of calls, so that an interrupted bench resumes.

A full MT-bench run is hours of CPU. Each block of a phase (one prompt of one repeat, every method
once, interleaved; eagle_tree.bench.timing) is appended to ``bench_journal.jsonl`` in the output
folder as soon as its last method returns: the outputs' new tokens, rounds and token times, each
call's wall time and peak memory. A rerun of the same command reads the blocks back and runs only the
missing ones; ``max_minutes`` stops a run between blocks so that a long benchmark can be spread over
several sittings. Every line carries the key of its phase: a hash of everything that decides what the
phase measures (the methods and their shapes, the prompts' token ids, budget, sampling, seed, the
target's and the head's weights, threads, device, dtype, packing). Lines of another key are ignored,
so a changed config measures afresh; a line cut short by a kill is ignored too. Each block's methods
still ran together on one machine, which is what the speed-ups compare; blocks of different sittings
may not (the report counts the sittings).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eagle_tree.bench.timing import Timed
from eagle_tree.decoding.decoder import GenerateOutput
from eagle_tree.decoding.rounds import RoundStats

JOURNAL_FILE = "bench_journal.jsonl"

__all__ = ["JOURNAL_FILE", "Journal", "phase_key", "weights_fingerprint"]


def weights_fingerprint(module: torch.nn.Module | None) -> str | None:
    """A short hash of a model's parameter shapes and leading values (None for no model)."""
    if module is None:
        return None
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(p.detach().flatten()[:256].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def phase_key(**parts: Any) -> str:
    """The hash of a phase's description (json of ``parts``, keys sorted; other objects by repr)."""
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _encode(call: Timed[GenerateOutput]) -> dict:
    o = call.value
    return {"seconds": call.seconds, "peak_bytes": call.peak_bytes, "prompt_length": o.prompt_length,
            "new": o.sequences[0, o.prompt_length:].tolist(), "rounds": [asdict(r) for r in o.rounds],
            "prefill_s": o.prefill_s, "total_s": o.total_s, "token_times": list(o.token_times),
            "stopped_by": o.stopped_by}


def _decode(method: str, block: int, row: dict, prompt: torch.Tensor) -> Timed[GenerateOutput]:
    if row["prompt_length"] != prompt.shape[-1]:
        raise ValueError("prompt length differs")
    new = torch.tensor([row["new"]], dtype=prompt.dtype, device=prompt.device)
    out = GenerateOutput(torch.cat([prompt.reshape(1, -1), new], dim=1), row["prompt_length"],
                         [RoundStats(**r) for r in row["rounds"]], row["prefill_s"], row["total_s"],
                         list(row["token_times"]), row["stopped_by"])
    return Timed(method, block, out, row["seconds"], row["peak_bytes"])


class Journal:
    """Finished blocks of one bench output folder, by phase key."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def load(self, key: str, prompts, methods: list[str]) -> tuple[dict[int, dict[str, Timed[GenerateOutput]]],
                                                                   set[int]]:
        """The blocks recorded under ``key`` (block -> method -> call) and the sittings they came from;
        ``prompts[block % len(prompts)]`` rebuilds each sequence. Lines of other keys, torn lines and
        incomplete blocks are skipped."""
        done: dict[int, dict[str, Timed[GenerateOutput]]] = {}
        sittings: set[int] = set()
        if not self.path.is_file():
            return done, sittings
        n = len(prompts)
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                if row.get("key") != key or sorted(row["calls"]) != sorted(methods):
                    continue
                b = int(row["block"])
                done[b] = {m: _decode(m, b, c, prompts[b % n]) for m, c in row["calls"].items()}
                sittings.add(int(row.get("sitting", 0)))
            except (ValueError, KeyError, TypeError, IndexError):
                continue  # a line cut short by a kill, or not ours
        return done, sittings

    def append(self, key: str, block: int, calls: Mapping[str, Timed[GenerateOutput]], sitting: int) -> None:
        """Add one finished block (flushed and synced before returning)."""
        row = {"key": key, "block": block, "sitting": sitting, "calls": {m: _encode(c) for m, c in calls.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = False
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"  # a kill cut the last line: start on a fresh one
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(("\n" if torn else "") + json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def sittings(self) -> int:
        """How many sittings wrote the journal so far (0 when it is empty or missing)."""
        if not self.path.is_file():
            return 0
        seen = set()
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                seen.add(int(json.loads(line)["sitting"]))
            except (ValueError, KeyError, TypeError):
                continue
        return max(seen) + 1 if seen else 0

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
