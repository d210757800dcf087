"""The one optimiser setup and learning-rate schedule of eagle_tree: the head training, the reference
target builder and the toy target builder all use :func:`adamw` and :func:`lr_factor`.

The schedule is a linear warm-up from ``1 / warmup_steps`` of the peak (the first step already learns),
then a cosine or linear decay to ``min_lr_ratio`` of the peak at ``total_steps``, or a constant."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

__all__ = ["lr_factor", "adamw", "lambda_schedule"]

ScheduleKind = Literal["cosine", "linear", "constant"]


def lr_factor(step: int, warmup_steps: int, total_steps: int, kind: ScheduleKind = "cosine",
              min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr at optimiser step ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def lambda_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int | Callable[[], int],
                    kind: ScheduleKind = "cosine", min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """:func:`lr_factor` as a resumable scheduler (its state is the step count). ``total_steps`` may be a
    function, read at every step (a step count resolved after the first steps, from a time budget)."""
    total = total_steps if callable(total_steps) else (lambda: total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda n: lr_factor(n, warmup_steps, total(), kind, min_lr_ratio))


def adamw(model: torch.nn.Module, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
          eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``model``, weight decay on matrices only (not norms, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
