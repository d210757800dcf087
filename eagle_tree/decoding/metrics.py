"""Acceptance and timing figures over many generations (docs/MEASURING.md, "Figures over many calls").

Acceptance length (tau) = committed tokens / speculative rounds, counting the correction or bonus
token. Time per output token = cumulative wall time / cumulative committed tokens, never a mean of
per-round ratios. The survival curve is Pr(A >= i), A = draft tokens accepted in a round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def survival_curve(accepted_per_round: Sequence[int], depth: int) -> list[float]:
    """Pr(A >= i) for i = 1..depth over rounds, A = accepted draft tokens in the round."""
    n = len(accepted_per_round)
    if n == 0:
        return [0.0] * depth
    return [sum(a >= i for a in accepted_per_round) / n for i in range(1, depth + 1)]


def per_position_acceptance(survival: Sequence[float]) -> list[float | None]:
    """Pr(A >= i | A >= i - 1) for i = 1..depth from a survival curve: how often the draft token at
    depth i is accepted once every token above it was (None where no round reached depth i - 1)."""
    out, previous = [], 1.0
    for s in survival:
        out.append(s / previous if previous > 0 else None)
        previous = s
    return out


def quantile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) by linear interpolation between order statistics (numpy's default
    and torch.quantile's); None for no values. The one quantile of the decoding and serving figures."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _quantile(values: Sequence[float], q: float) -> float:
    value = quantile(values, q)
    return float("nan") if value is None else value


@dataclass
class DecodeSummary:
    method: str
    temperature: float
    acceptance_length: float  # committed tokens per round (1.0 for plain decoding)
    time_per_output_token_s: float
    decode_time_per_token_s: float  # after the first token: (total - prefill) / (tokens - 1) per call, pooled
    tokens: int
    rounds: int
    prompts: int
    time_to_first_token_s: float  # mean over prompts
    latency_s: float  # mean end-to-end latency per prompt
    gap_p50_s: float  # gaps between streamed tokens
    gap_p95_s: float
    draft_s_per_round: float
    verify_s_per_round: float
    other_s_per_round: float
    survival: list[float]
    eos_stops: int

    def to_dict(self) -> dict:
        return asdict(self)


def decode_time_per_token(outputs: Sequence) -> float:
    """Seconds per output token after each call's first: the wall time after the prefill (which ends with the
    first token) over the tokens committed after it, pooled over calls (the TPOT of serving benchmarks).
    Unlike ``time_per_output_token_s`` it does not move with the prompt's length through the prefill, so two
    turns of one conversation compare on decoding alone. NaN when no call committed a second token."""
    later = sum(max(o.new_tokens - 1, 0) for o in outputs)
    if later == 0:
        return float("nan")
    return sum(o.total_s - o.prefill_s for o in outputs if o.new_tokens > 1) / later


def summarize(method: str, temperature: float, outputs: Sequence, depth: int = 0) -> DecodeSummary:
    """Aggregate GenerateOutput objects of one method (same prompts, budget and sampling)."""
    rounds = [r for o in outputs for r in o.rounds]
    tokens = sum(o.new_tokens for o in outputs)
    total = sum(o.total_s for o in outputs)
    gaps = [b - a for o in outputs for a, b in zip(o.token_times, o.token_times[1:], strict=False)]
    n_rounds = max(len(rounds), 1)
    committed_in_rounds = sum(r.committed for r in rounds)
    return DecodeSummary(
        method=method,
        temperature=temperature,
        acceptance_length=committed_in_rounds / n_rounds if rounds else 0.0,
        time_per_output_token_s=total / max(tokens, 1),
        decode_time_per_token_s=decode_time_per_token(outputs),
        tokens=tokens,
        rounds=len(rounds),
        prompts=len(outputs),
        time_to_first_token_s=sum(o.prefill_s for o in outputs) / max(len(outputs), 1),
        latency_s=total / max(len(outputs), 1),
        gap_p50_s=_quantile(gaps, 0.5),
        gap_p95_s=_quantile(gaps, 0.95),
        draft_s_per_round=sum(r.draft_s for r in rounds) / n_rounds,
        verify_s_per_round=sum(r.verify_s for r in rounds) / n_rounds,
        other_s_per_round=sum(r.other_s for r in rounds) / n_rounds,
        survival=survival_curve([r.accepted for r in rounds], depth),
        eos_stops=sum(o.stopped_by == "eos" for o in outputs),
    )
