"""The distribution contract: one function turns logits into the processed distribution ``p``.

Warpers are applied in the order of Hugging Face ``generate``: temperature, then top-k, then
top-p; the result is renormalised and returned in float32. Temperature 0 means greedy: a point
mass at the argmax, ties broken by the smallest token id. So does every temperature below
:data:`GREEDY_BELOW` (float32's smallest normal number, about 1.2e-38): divided in float32 it would
underflow to 0 and give NaN, and the law it stands for is the argmax up to ties. Both the target
side and the draft side of speculative decoding use this one function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)  # temperatures below this decode greedily


@dataclass(frozen=True)
class SamplingConfig:
    """How the target would sample one token on its own.

    temperature: 0.0 selects greedy decoding (argmax, smallest id on ties), and so does any value below
    GREEDY_BELOW (about 1.2e-38, where float32 division underflows); above it, divides logits.
    top_k: keep the k most likely tokens (ties with the k-th value kept, as in Hugging Face); 0 = off.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 = off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables top-k), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1] (1.0 disables top-p), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temperature 0, or below GREEDY_BELOW."""
        return self.temperature < GREEDY_BELOW


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim with ties broken by the smallest token id. (...,) int64."""
    ids = torch.arange(logits.shape[-1], device=logits.device)
    is_max = logits == logits.max(dim=-1, keepdim=True).values
    return torch.where(is_max, ids, logits.shape[-1]).min(dim=-1).values


def processed_probs(logits: torch.Tensor, sampling: SamplingConfig, check: bool = True) -> torch.Tensor:
    """Logits (..., V) -> processed next-token distribution (..., V), float32, rows sum to 1.

    ``check=False`` skips the input checks (NaN, +inf, rows of -inf), each a host synchronisation:
    for internal callers whose logits come from a model already checked once per call."""
    if check:
        _check_logits(logits)
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(greedy_token(logits), logits.shape[-1]).float()

    # shifting by the row max first keeps a tiny temperature from overflowing to inf (softmax is shift-invariant)
    scores = (logits - logits.max(dim=-1, keepdim=True).values) / sampling.temperature
    if sampling.top_k > 0:
        k = min(sampling.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False, stable=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - sampling.top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(dim=-1)


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() == 0:
        raise ValueError("logits must have a vocabulary dimension, got a scalar")
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN; the model produced invalid scores")
    if (logits == float("inf")).any():
        raise ValueError("logits contain +inf; the model produced invalid scores")
    if (logits == float("-inf")).all(dim=-1).any():
        raise ValueError("a row of logits is entirely -inf; no token can be sampled")
