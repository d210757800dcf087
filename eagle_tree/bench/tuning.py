"""Choosing the draft shape: the candidates, the selection rule and the tuning file (docs/MEASURING.md,
"The bench", step 4). The one owner of shape tuning for ``eagle-tree bench`` and the serving sweep.

Per shape, the per-round means ``C`` (seconds: drafting + verification + the rest) and ``K`` (tokens
committed: accepted draft tokens + the correction or bonus token) give the steady-state time per
output token ``C / K``; the prefill is the same for every shape and is left out. The best shape is
the one with the lowest ``C / K``. The marginal rule says the same thing one step at a time: growing a
shape (a longer chain, a deeper or wider tree) with deltas ``dC``, ``dK > 0`` pays exactly when
``dC / dK < C / K``, since then ``(C + dC) / (K + dK) < C / K``::

    best = pick_best([ShapeMeasurement(TreeConfig.chain(3), round_s=0.030, committed=2.1), ...])

Plain decoding is a candidate too, named ``none`` (:data:`NONE`; ``ShapeMeasurement(None, C, 1)``:
one token per round, C its mean round time): where no draft shape's C / K is below a plain step's,
the best is ``none`` and the head's decoding defaults say "do not speculate". It is the smallest
shape, so a tie goes to it; the other selection keys and the marginal tables are about drafted shapes
only. Context branches (``TreeConfig.context``) are tuned the same way: a shape with context is one more
candidate, named ``chain-4+ctx8`` (``TreeConfig.name``). The marginal tables follow each context
setting's own growth sequence. The serving sweep picks, per batch size, the candidate with the highest
throughput (:func:`pick_tuned`). The bench writes its result as ``shapes.json``
(:func:`save_tuned_shapes`), which ``eagle_tree.decoding.shapes.load_tuned_shape`` reads back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from eagle_tree.decoding.context import ContextConfig
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.shapes import NONE, SHAPES_FORMAT

if TYPE_CHECKING:
    from eagle_tree.bench.runner import PhaseResult

CHAIN_LENGTHS = (1, 2, 3, 4, 6, 8)
"""The bench's candidate chain lengths."""
TREES = (TreeConfig(depth=4, top_k=4, total_tokens=16), TreeConfig(depth=5, top_k=6, total_tokens=32),
         TreeConfig(depth=6, top_k=8, total_tokens=48))
"""The bench's candidate trees."""
SERVING_CANDIDATES = ("none", "chain-1", "chain-2", "chain-3", "tree-d2k2n4", "tree-d3k2n6", "tree-d4k4n16")
"""The serving sweep's candidates per batch size (none: plain decoding)."""


def candidate_shapes(chain_lengths: Iterable[int], trees: Iterable[TreeConfig],
                     contexts: Iterable[ContextConfig] = (), context_only: bool = False) -> list[TreeConfig]:
    """Chains of ``chain_lengths`` and ``trees``, each without context and with every ``contexts`` entry;
    with ``context_only``, every ``contexts`` entry alone too (``ctx8``: no head), so the head's drafts
    must beat the context branches without them to be chosen."""
    shapes = [TreeConfig.chain(n, sampled=False) for n in chain_lengths] + list(trees)
    shapes += [replace(s, context=c) for c in contexts for s in shapes if s.context is None]
    if context_only:
        shapes += [TreeConfig.context_only(c) for c in contexts]
    return list(dict.fromkeys(shapes))


@dataclass(frozen=True)
class ShapeMeasurement:
    """Per-round means of one draft shape: ``round_s`` = C (seconds), ``committed`` = K (tokens);
    ``tree`` None is plain decoding (named :data:`NONE`, K = 1)."""

    tree: TreeConfig | None
    round_s: float
    committed: float
    rounds: int = 0
    """How many rounds the means are over (0: unknown)."""

    def __post_init__(self) -> None:
        if not (self.round_s > 0 and math.isfinite(self.round_s)):
            raise ValueError(f"round_s (C) must be a positive finite number of seconds, got {self.round_s!r}")
        if not (self.committed > 0 and math.isfinite(self.committed)):
            raise ValueError(f"committed (K) must be a positive finite number of tokens, got {self.committed!r}")

    @property
    def name(self) -> str:
        return NONE if self.tree is None else self.tree.name

    @property
    def drafted(self) -> bool:
        """Whether the shape drafts (False: plain decoding)."""
        return self.tree is not None

    @property
    def size(self) -> int:
        """Draft nodes per round (0: plain decoding), the tie-break of :func:`pick_best`."""
        return 0 if self.tree is None else self.tree.total_tokens

    @property
    def time_per_token(self) -> float:
        """C / K: seconds per committed token in steady state."""
        return self.round_s / self.committed

    def to_dict(self) -> dict:
        return {"name": self.name, "tree": None if self.tree is None else asdict(self.tree), "round_s": self.round_s,
                "committed": self.committed, "rounds": self.rounds, "time_per_token_s": self.time_per_token}

    @classmethod
    def from_dict(cls, d: dict) -> ShapeMeasurement:
        tree = None if d["tree"] is None else TreeConfig(**d["tree"])
        return cls(tree, float(d["round_s"]), float(d["committed"]), int(d.get("rounds", 0)))


def change_helps(round_s: float, committed: float, d_round_s: float, d_committed: float) -> bool:
    """The marginal rule: does a change of the shape with deltas (dC, dK) lower C / K?

    For ``dK > 0`` this is ``dC / dK < C / K``. A change that commits no more tokens (``dK == 0``)
    helps only if it saves time, and one that commits fewer (``dK < 0``) only if ``(C + dC) / (K + dK)``
    is still lower; both follow from comparing the two ratios, which this rule is a form of.
    """
    if not (round_s > 0 and committed > 0):
        raise ValueError(f"C and K must be positive, got C={round_s!r}, K={committed!r}")
    if d_committed > 0:
        return d_round_s / d_committed < round_s / committed
    if d_committed == 0:
        return d_round_s < 0
    if committed + d_committed <= 0:
        raise ValueError(f"K + dK must stay positive, got K={committed!r}, dK={d_committed!r}")
    return (round_s + d_round_s) / (committed + d_committed) < round_s / committed


def pick_best(measurements: Sequence[ShapeMeasurement]) -> ShapeMeasurement:
    """The shape with the lowest C / K; ties go to the smaller shape (fewer draft nodes; plain decoding,
    ``none``, has none, so it wins every tie), then the earlier."""
    if not measurements:
        raise ValueError("pick_best needs at least one measured shape")
    order = range(len(measurements))
    best = min(order, key=lambda i: (measurements[i].time_per_token, measurements[i].size, i))
    return measurements[best]


@dataclass(frozen=True)
class MarginalStep:
    """One growth step ``small -> large`` judged by the marginal rule."""

    small: str
    large: str
    d_round_s: float
    d_committed: float
    threshold_s: float  # C / K of the smaller shape
    helps: bool

    @property
    def marginal_s(self) -> float:
        """dC / dK (inf when dK <= 0)."""
        return self.d_round_s / self.d_committed if self.d_committed > 0 else math.inf


def marginal_steps(growth: Sequence[ShapeMeasurement]) -> list[MarginalStep]:
    """Judge each consecutive pair of a growth sequence (e.g. chains of length 1, 2, 3, ...)."""
    steps = []
    for small, large in zip(growth, growth[1:], strict=False):
        d_c, d_k = large.round_s - small.round_s, large.committed - small.committed
        steps.append(MarginalStep(small.name, large.name, d_c, d_k, small.time_per_token,
                                  change_helps(small.round_s, small.committed, d_c, d_k)))
    return steps


def grow_while_helps(growth: Sequence[ShapeMeasurement]) -> ShapeMeasurement:
    """Walk a growth sequence from its smallest shape and stop at the first step that does not help."""
    if not growth:
        raise ValueError("grow_while_helps needs at least one measured shape")
    current = growth[0]
    for step, nxt in zip(marginal_steps(growth), growth[1:], strict=False):
        if not step.helps:
            break
        current = nxt
    return current


def growth_order(measurements: Sequence[ShapeMeasurement]) -> list[ShapeMeasurement]:
    """Drafted measurements sorted by size: draft nodes, then depth, then top-k (plain decoding left out)."""
    drafted = [m for m in measurements if m.drafted]
    return sorted(drafted, key=lambda m: (m.tree.total_tokens, m.tree.depth, m.tree.top_k))


# ------------------------------------------------------------------------------- the tuning file


def selection(measurements: Sequence[ShapeMeasurement]) -> dict[str, ShapeMeasurement]:
    """The best chain, the best tree and the best of all (``best``, which may be plain decoding,
    ``none``); when context settings were measured, also the best head shape without context
    (``no_context``), with it (``context``), the best context-only shape (``context_only``, no head) and
    the best chain and tree without context (``head_only_chain``, ``head_only_tree``). Every key but
    ``best`` names a drafted shape. Keys present only when measured."""
    chosen = {"best": pick_best(measurements)}
    shapes = [m for m in measurements if m.drafted]
    drafted = [m for m in shapes if m.tree.head]
    groups = {
        "chain": [m for m in drafted if m.tree.is_chain],
        "tree": [m for m in drafted if not m.tree.is_chain],
        "no_context": [m for m in drafted if m.tree.context is None],
        "context": [m for m in drafted if m.tree.context is not None],
        "context_only": [m for m in shapes if not m.tree.head],
        "head_only_chain": [m for m in drafted if m.tree.is_chain and m.tree.context is None],
        "head_only_tree": [m for m in drafted if not m.tree.is_chain and m.tree.context is None],
    }
    if not groups["context"]:
        for kind in ("no_context", "head_only_chain", "head_only_tree"):
            del groups[kind]
    for kind, group in groups.items():
        if group:
            chosen[kind] = pick_best(group)
    return chosen


def _growth_sequences(measurements: Sequence[ShapeMeasurement]) -> dict[str, list[ShapeMeasurement]]:
    """Chains and trees, each context setting apart: ``chain``, ``tree``, ``chain+ctx8``, ..."""
    sequences: dict[str, list[ShapeMeasurement]] = {"chain": [], "tree": []}
    for m in measurements:
        if not m.drafted or not m.tree.head:
            continue  # plain decoding or context alone: nothing to grow
        kind = "chain" if m.tree.is_chain else "tree"
        if m.tree.context is not None:
            kind += f"+{m.tree.context.name}"
        sequences.setdefault(kind, []).append(m)
    return {kind: growth_order(seq) for kind, seq in sequences.items()}


def save_tuned_shapes(path: str | Path, measurements: Sequence[ShapeMeasurement], **context) -> dict:
    """Write the measured shapes, the selection and the marginal tables to ``path`` (JSON); ``context``
    (e.g. the temperature, the prompt file, the machine) is stored alongside. Returns the written dict."""
    chosen = selection(measurements)
    data = {
        "format": SHAPES_FORMAT,
        "criterion": "lowest C / K: mean round time over mean tokens committed per round",
        "selected": {kind: m.name for kind, m in chosen.items()},
        "shapes": [m.to_dict() for m in measurements],
        "marginal": {kind: [_step_dict(s) for s in marginal_steps(seq)]
                     for kind, seq in _growth_sequences(measurements).items()},
        "context": context,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, allow_nan=False))
    return data


def _step_dict(step: MarginalStep) -> dict:
    marginal = step.marginal_s
    return asdict(step) | {"marginal_s": marginal if math.isfinite(marginal) else None}


def shape_measurements(result: PhaseResult) -> list[ShapeMeasurement]:
    """Per-round means C (seconds) and K (committed tokens) of every eagle shape of a phase, and of
    plain decoding in eagle-tree's loop (the eagle method without tree or head: :data:`NONE`, one token
    a round) when the phase ran it."""
    measured = []
    for method in result.methods:
        plain, shape = method.tree is None and not method.head, method.tree is not None and method.head
        if method.kind != "eagle" or not (plain or shape):
            continue  # an HF method, the head folder's defaults or a context-only method of the comparison
        rounds = [r for rep in result.outputs[method.name] for o in rep for r in o.rounds]
        if not rounds:
            raise ValueError(f"{method.name} ran no speculative round; raise max_new_tokens")
        c = sum(r.total_s for r in rounds) / len(rounds)
        k = sum(r.committed for r in rounds) / len(rounds)
        measured.append(ShapeMeasurement(method.tree, c, k, len(rounds)))
    return measured


def pick_tuned(throughputs: Mapping[str, float]) -> str:
    """The candidate shape with the highest throughput (the first one listed on a tie)."""
    if not throughputs:
        raise ValueError("no candidate shape was measured")
    return max(throughputs, key=lambda name: throughputs[name])


def crossover_batch_size(tuned: Mapping[int, str]) -> int | None:
    """The smallest batch size from which on the tuned shape is plain decoding (``none``) at every
    larger batch size measured; None when speculation still wins at the largest one."""
    crossover = None
    for batch in sorted(tuned, reverse=True):
        if tuned[batch] != NONE:
            break
        crossover = batch
    return crossover


