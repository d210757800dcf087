"""An int8 draft ``lm_head`` for CPU drafting (docs/MEASURING.md, "Linear kernels on CPU").

A draft step on CPU is bound by its ``lm_head``: for the SmolLM2 head (8,192 draft tokens, hidden 576)
the float32 matrix is 18.9 MB, read whole for every step, about 2.4 ms of a 3 to 4 ms forward at one
row, and 6 ms for the 4 rows of a tree level. A per-row int8 copy is 4.7 MB, and torch's dynamically
quantized linear (``quantized::linear_dynamic``: the rows of the input quantized on the fly, int8
products summed in int32) multiplies by it in about a tenth of the time (measured in MEASURING.md).

This changes the draft, never the output's distribution: the head's logits move by about 1e-2 (its
top-1 token almost never changes), and the drafter samples from, and reports, the distribution of the
logits it computed, which is all the acceptance rule needs (docs/EXACTNESS.md). :func:`quantize_lm_head`
swaps the head's ``lm_head`` for an :class:`Int8Linear` that keeps the float32 weight (state dicts,
saving and training read it unchanged) and uses the int8 copy only for forwards without gradients on
CPU. Opt-in: ``head_int8: true`` in the bench and decode configs, ``load_decoder(..., head_int8=True)``.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Int8Linear", "int8_available", "quantize_lm_head"]

REDUCE_RANGE = True
"""Quantize activations to 7 bits, as x86 / fbgemm kernels need to keep int16 partial sums from saturating."""


def int8_available() -> bool:
    """Whether this torch build has the dynamically quantized linear kernels (x86 and fbgemm builds do)."""
    try:
        engines = torch.backends.quantized.supported_engines
        return any(e in engines for e in ("x86", "fbgemm")) and hasattr(torch.ops.quantized, "linear_dynamic")
    except (AttributeError, RuntimeError):
        return False


class Int8Linear(nn.Module):
    """``nn.Linear`` without bias plus a per-row int8 copy of its weight for CPU forwards without
    gradients. The copy is made from the weight at construction (of an ``nn.Linear`` or of another
    ``Int8Linear``): call :func:`quantize_lm_head` again after changing the weight."""

    def __init__(self, linear: nn.Linear | Int8Linear):
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("Int8Linear quantizes bias-free layers only (the head's lm_head)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same parameter: state dicts, saving and training are unchanged
        w = linear.weight.detach().float().cpu()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch marks quantized tensor creation as deprecated; the kernels stay
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu" or not x.is_floating_point():
            return F.linear(x, self.weight)
        flat = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.ops.quantized.linear_dynamic(flat, self._packed, REDUCE_RANGE)  # float32 out
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 copy (per row)"


def quantize_lm_head(head: nn.Module) -> bool:
    """Give ``head.lm_head`` an int8 copy for drafting (:class:`Int8Linear`); a head already quantized is
    requantized from its current weight. Returns True. Raises RuntimeError when the kernels are missing
    or the head is not a float32 (or float64) head on CPU."""
    if not int8_available():
        raise RuntimeError("head_int8 needs torch's quantized linear kernels (x86 or fbgemm engine), which this "
                           "torch build lacks: set head_int8=false")
    weight = head.lm_head.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.float64):
        raise RuntimeError(f"head_int8 is for float32 (or float64) heads on CPU; this head's lm_head is "
                           f"{weight.dtype} on {weight.device}: set head_int8=false")
    head.lm_head = Int8Linear(head.lm_head)  # an Int8Linear already there: requantized from its weight
    return True
