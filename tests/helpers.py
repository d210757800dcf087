"""Test-only helpers: ``load_script``, a repository script loaded as a module; around the head, a
concatenating key/value store for ``Eagle3DraftModel.step`` (the reference chains recompute paths with
it) and ``follow``, a drafter's logits along a given chain."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """A repository script outside the package (``train/curve.py``, ``decode/head_report.py``) loaded
    as a module by its path. It is registered in ``sys.modules`` under ``<folder>_<stem>`` before it
    runs, as dataclasses look their module up there."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class PastKV:
    """An ``AttentionCache`` that keeps every entry it is given, in order: ``attend`` appends the new
    keys and values (B, nkv, T, hd) and attends over all of them with a bool mask (B or 1, 1, T, S + T)
    over [earlier, new]. ``copy()`` branches it (a path recomputed below a shared prefix)."""

    def __init__(self, k: torch.Tensor | None = None, v: torch.Tensor | None = None):
        self.k, self.v = k, v

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def attend(self, attn, q, k, v, mask):
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        return attn.attend(q, self.k, self.v, mask)

    def copy(self) -> PastKV:
        return PastKV(self.k, self.v)


@torch.no_grad()
def follow(drafter, tokens: list[int]) -> list[torch.Tensor]:
    """Draft logits (Vd,) at depths 1..len(tokens)+1 along a given chain of target ids below the root
    of a one-request ``Drafter``; its cache is left as it was. Training's step s equals depth s + 1."""
    committed, hidden = drafter.cache.length, drafter.last_hidden
    logits = [drafter.logits[0]]
    try:
        for depth, token in enumerate(tokens, start=1):
            ids = torch.tensor([[token]], device=hidden.device)
            pos = torch.tensor([[committed - 1 + depth]], device=hidden.device)
            visible = torch.ones(1, 1, 1, drafter.cache.length + 1, dtype=torch.bool, device=hidden.device)
            hidden, step_logits = drafter.draft.step(hidden, ids, pos, drafter.cache, visible)
            logits.append(step_logits[0, -1].float())
    finally:
        drafter.cache.crop(committed)
    return logits
