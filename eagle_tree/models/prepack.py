"""Prepacked linear layers for the CPU target (docs/MEASURING.md, "Linear kernels on CPU").

On CPU a verification forward of 2 to 12 tokens can cost far more than a one-token step (on
SmolLM2-135M at 1 thread on one host: 1.6 steps for 2 tokens, 1.7 for 5) though it reads the same
weights: the matrix-matrix routine behind ``F.linear`` repacks every weight matrix on every call. oneDNN
can pack a weight once (``torch.ops.mkldnn._reorder_linear_weight``) and multiply rows by the packed copy
(``_linear_pointwise``) at close to one row's cost. On other hosts the one-row matrix-vector routine of
``F.linear`` is itself the slow one (an AMD EPYC host: SmolLM2's 49,152-row ``lm_head`` took 7.9 ms a row
with ``F.linear`` and 2.8 ms packed), so by default the packed copy serves every forward of the frozen
target, one row included: the plain decoding step, prefill and verification then run one kernel, and a
plain step is as fast as the host allows (a fair denominator for speed-ups). ``one_row=False`` keeps
``F.linear`` for one-row inputs (the earlier behaviour; ``decode/verify_rows.py`` measures both).

:func:`prepack_linears` swaps every ``nn.Linear`` of a frozen model for a :class:`PackedLinear`. It is
opt-in (``TargetModel.from_pretrained(..., prepack=True)``, ``target_prepack: true`` in the bench and
decode configs): the packed copy doubles the memory of the weights, and it changes float32 rounding
(the sums run in another order: differences of about 1e-5 relative), as the matrix-matrix path already
differs from the matrix-vector one. Only float32 weights on CPU are packed, and the packed copy serves
only forwards without gradients (the target's, under ``torch.no_grad``).
"""

from __future__ import annotations

import copy

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
    """``nn.Linear`` with a oneDNN-packed copy of its weight, used for every input without gradients
    (``one_row=False``: for inputs of more than one row only)."""

    def __init__(self, linear: nn.Linear, one_row: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.one_row = bool(one_row)
        self.weight, self.bias = linear.weight, linear.bias  # the same parameters: ties and state dicts hold
        # A plain attribute, not a buffer: the packed copy is a kernel choice, not part of the model, so it
        # stays out of named_buffers (and so out of fingerprints, state dicts and weight checks), as
        # Int8Linear's copy does. It is made from the weight here: repack after changing the weight.
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def __deepcopy__(self, memo):
        # oneDNN's packed tensor has no storage to copy: copy the rest, then pack the copied weight again
        state = {k: v for k, v in self.__dict__.items() if k != "_packed"}
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(state, memo))
        new._packed = torch.ops.mkldnn._reorder_linear_weight(new.weight.detach(), None)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ((not self.one_row and x.numel() == x.shape[-1]) or x.dtype != torch.float32 or torch.is_grad_enabled()
                or x.device.type != "cpu"):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"one_row={self.one_row}")


def prepack_linears(model: nn.Module, one_row: bool = True) -> int:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear` (``one_row``: whether
    one-row inputs use the packed copy too); return how many. Raises RuntimeError when this torch build
    lacks the packed kernels."""
    if not prepack_available():
        raise RuntimeError("prepack needs torch's oneDNN packed linear (torch.ops.mkldnn._linear_pointwise), "
                           "which this torch build lacks; load the target without prepack")
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(module, name, PackedLinear(child, one_row=one_row))
                swapped += 1
    return swapped
