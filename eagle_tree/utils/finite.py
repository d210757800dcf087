"""Refusing non-finite weights: a head (or any module) holding NaN or infinite values is an error that
names the tensors, never something to decode with or export."""

from __future__ import annotations

import torch

__all__ = ["NonFiniteError", "nonfinite_tensors", "check_finite"]


class NonFiniteError(ValueError):
    """Weights or a loss hold NaN or infinite values."""


def nonfinite_tensors(module: torch.nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``module`` that hold a NaN or an infinity."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return [name for name, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def check_finite(head: torch.nn.Module, where: str = "the head") -> None:
    """Raise NonFiniteError naming the non-finite weights of ``head`` (``where`` says whose: a path)."""
    bad = nonfinite_tensors(head)
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise NonFiniteError(
            f"{where} has non-finite (NaN or infinite) weights in {', '.join(bad[:5])}{more}: its training "
            "diverged; use an earlier checkpoint or retrain it (e.g. with a lower optim.lr)")
