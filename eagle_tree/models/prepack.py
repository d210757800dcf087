"""Prepacked linear layers for CPU verification (docs/MEASURING.md, "Linear kernels on CPU").

On CPU a verification forward of 2 to 12 tokens costs far more than a one-token step (on
SmolLM2-135M at 1 thread: 1.6 steps for 2 tokens, 1.7 for 5) though it reads the same weights: the
matrix-matrix routine behind ``F.linear`` repacks every weight matrix on every call, while the one-row
call takes a matrix-vector path that reads it once. oneDNN can pack a weight once
(``torch.ops.mkldnn._reorder_linear_weight``) and multiply a few rows by the packed copy
(``_linear_pointwise``) at close to one row's cost. :func:`prepack_linears` swaps every ``nn.Linear``
of a frozen model for a :class:`PackedLinear` that keeps the original weight for one-row inputs (the
plain decoding step, unchanged) and uses the packed copy for more rows (verification, prefill).

It is opt-in (``TargetModel.from_pretrained(..., prepack=True)``, ``target_prepack: true`` in the bench
and decode configs): the packed copy doubles the memory of the weights, and it changes float32 rounding
of multi-row forwards (the sums run in another order: differences of about 1e-5 relative), as the
matrix-matrix path already differs from the matrix-vector one. Only float32 weights on CPU are packed,
and the packed copy serves only forwards without gradients (the target's, under ``torch.no_grad``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["PackedLinear", "prepack_available", "prepack_linears"]


def prepack_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 CPU builds do)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and ops is not None
                    and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """``nn.Linear`` with a oneDNN-packed copy of its weight for inputs of more than one row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same parameters: ties and state dicts hold
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1] or x.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear`; return how many.
    Raises RuntimeError when this torch build lacks the packed kernels."""
    if not prepack_available():
        raise RuntimeError("prepack needs torch's oneDNN packed linear (torch.ops.mkldnn._linear_pointwise), "
                           "which this torch build lacks; load the target without prepack")
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(module, name, PackedLinear(child))
                swapped += 1
    return swapped
