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

Packing does not pay on every host: on an Intel host with AMX the packed copy was slower than
``F.linear`` at every row count (docs/MEASURING.md, "One-row steps"). ``prepack="auto"``
(:func:`apply_prepack`, :func:`choose_prepack`) times the model's own linear layers at load, one row
and five rows, both ways and interleaved, and keeps the packed copy only for the row counts where it
is faster (none: the model is left with its ``nn.Linear`` layers). The choice and its timings are a
:class:`PrepackChoice`, which the bench records with its conditions.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["PackedLinear", "PrepackChoice", "PrepackSetting", "apply_prepack", "choose_prepack", "prepack_available",
           "packed_kernels", "prepack_linears", "unpack_linears"]

PrepackSetting = bool | Literal["auto"]
"""A config's ``target_prepack``: pack (true), do not (false), or time both at load and keep the faster."""


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
    (``one_row=False``: for inputs of more than one row only; ``many_rows=False``: for one-row inputs only)."""

    def __init__(self, linear: nn.Linear, one_row: bool = True, many_rows: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.one_row, self.many_rows = bool(one_row), bool(many_rows)
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
        packed = self.one_row if x.numel() == x.shape[-1] else self.many_rows
        if not packed or x.dtype != torch.float32 or torch.is_grad_enabled() or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"one_row={self.one_row}, many_rows={self.many_rows}")


def prepack_linears(model: nn.Module, one_row: bool = True, many_rows: bool = True) -> int:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear` (``one_row``: whether
    one-row inputs use the packed copy; ``many_rows``: whether inputs of several rows do); return how many.
    Raises RuntimeError when this torch build lacks the packed kernels."""
    if not prepack_available():
        raise RuntimeError("prepack needs torch's oneDNN packed linear (torch.ops.mkldnn._linear_pointwise), "
                           "which this torch build lacks; load the target without prepack")
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(module, name, PackedLinear(child, one_row=one_row, many_rows=many_rows))
                swapped += 1
    return swapped


def unpack_linears(model: nn.Module) -> int:
    """Put back an ``nn.Linear`` (the same weight and bias parameters) for every :class:`PackedLinear` of
    ``model``, freeing the packed copies; return how many."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, PackedLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                setattr(module, name, linear)
                swapped += 1
    return swapped


def packed_kernels(model: nn.Module) -> str | bool:
    """Which inputs ``model``'s linear layers run through a packed copy, read off its layers (so true of the
    model, whatever the config asked): False, "every-row-count", "several-rows", "one-row" or "mixed"."""
    flags = {(m.one_row, m.many_rows) for m in model.modules() if isinstance(m, PackedLinear)} - {(False, False)}
    if not flags:
        return False
    if len(flags) > 1:
        return "mixed"
    return PrepackChoice(*flags.pop()).kernels()


@dataclass(frozen=True)
class PrepackChoice:
    """Which row counts run through the packed copy, and, when ``prepack="auto"`` chose, the timings it
    chose by: ``ms[(rows, kernel)]``, milliseconds for one pass over every linear layer of the model at
    that row count (``kernel``: "linear" for ``F.linear``, "packed"), medians of interleaved repeats."""

    one_row: bool
    many_rows: bool
    ms: Mapping[tuple[int, str], float] = field(default_factory=dict)
    reason: str = "asked"

    @property
    def packs(self) -> bool:
        return self.one_row or self.many_rows

    def kernels(self) -> str | bool:
        """A stable name of the choice (no timings), e.g. for a bench journal's identity."""
        if not self.packs:
            return False
        return {(True, True): "every-row-count", (False, True): "several-rows", (True, False): "one-row"}[
            (self.one_row, self.many_rows)]

    def as_dict(self) -> dict:
        return {"packed": self.kernels(), "reason": self.reason,
                "ms_per_pass": {f"rows={r} {k}": round(v, 3) for (r, k), v in sorted(self.ms.items())}}

    def describe(self) -> str:
        timings = ", ".join(f"{r} row{'s' * (r > 1)}: F.linear {self.ms[(r, 'linear')]:.1f} ms, packed "
                            f"{self.ms[(r, 'packed')]:.1f} ms" for r in sorted({r for r, _ in self.ms}))
        what = "packed linear layers for " + {"every-row-count": "every row count", "several-rows":
                                              "inputs of several rows", "one-row": "one-row inputs"}[self.kernels()] \
            if self.packs else "F.linear (no packed copy)"
        return f"{what} ({self.reason}{': ' + timings if timings else ''})"


Measure = Callable[[Mapping[str, Callable[[], None]]], Mapping[str, float]]


def interleaved_medians(fns: Mapping[str, Callable[[], None]], repeats: int = 5,
                        clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds for each of ``fns``: one warm-up call each, then ``repeats`` rounds calling each once in
    turn (so every function sees the same machine), the median per function."""
    for fn in fns.values():
        fn()
    seen: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            seen[name].append(clock() - t0)
    return {name: statistics.median(times) for name, times in seen.items()}


def choose_prepack(model: nn.Module, rows: Sequence[int] = (1, 5), repeats: int = 5,
                   measure: Measure | None = None) -> PrepackChoice:
    """Time every float32 CPU linear layer of ``model`` at each row count of ``rows`` through ``F.linear``
    and through a packed copy, and keep the packed copy where it is faster: for one-row inputs when it wins
    at one row, for several rows when it wins summed over the row counts above one. ``model`` ends packed
    accordingly (:class:`PackedLinear` with those flags) or with plain ``nn.Linear`` layers where packing
    wins nowhere. ``measure`` maps named callables to seconds (default :func:`interleaved_medians`)."""
    if not prepack_available():
        return PrepackChoice(False, False, reason="auto: this torch build has no oneDNN packed linear")
    rows = sorted(set(int(r) for r in rows))
    if not rows or rows[0] < 1:
        raise ValueError(f"rows={rows}: expected row counts of at least 1")
    prepack_linears(model)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not layers:
        return PrepackChoice(False, False, reason="auto: no float32 CPU linear layer")
    gen = torch.Generator().manual_seed(0)
    inputs = {r: [torch.randn(1, r, m.in_features, generator=gen) for m in layers] for r in rows}

    def run(r: int, packed: bool) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad():
                for layer, x in zip(layers, inputs[r], strict=True):
                    if packed:
                        torch.ops.mkldnn._linear_pointwise(x, layer._packed, layer.bias, "none", [], "")
                    else:
                        F.linear(x, layer.weight, layer.bias)
        return call

    fns = {f"{r} {k}": run(r, k == "packed") for r in rows for k in ("linear", "packed")}
    seconds = (measure or (lambda f: interleaved_medians(f, repeats)))(fns)
    ms = {(r, k): 1e3 * float(seconds[f"{r} {k}"]) for r in rows for k in ("linear", "packed")}
    one_row = 1 in rows and ms[(1, "packed")] < ms[(1, "linear")]
    many = [r for r in rows if r > 1]
    many_rows = bool(many) and sum(ms[(r, "packed")] for r in many) < sum(ms[(r, "linear")] for r in many)
    choice = PrepackChoice(one_row, many_rows, ms, reason="auto: timed at load")
    if choice.packs:
        for layer in layers:
            layer.one_row, layer.many_rows = one_row, many_rows
    else:
        unpack_linears(model)
    return choice


def apply_prepack(model: nn.Module, setting: PrepackSetting, one_row: bool = True,
                  measure: Measure | None = None) -> PrepackChoice | None:
    """The one entry point of the configs' ``target_prepack``: false leaves ``model`` as it is (None), true
    packs every float32 CPU linear layer (``one_row``: one-row inputs too), "auto" times both kernels and
    keeps the faster (:func:`choose_prepack`)."""
    if setting is False:
        return None
    if setting is True:
        prepack_linears(model, one_row=one_row)
        return PrepackChoice(one_row, True)
    if setting == "auto":
        return choose_prepack(model, measure=measure)
    raise ValueError(f"prepack={setting!r}: expected true, false or \"auto\" (time both kernels at load)")
