"""Choosing the draft shape from measurements (MEASURING.md, "Choosing draft shape").

Per shape, the per-round means ``C`` (seconds: drafting + verification + the rest) and ``K`` (tokens
committed: accepted draft tokens + the correction or bonus token) give the steady-state time per
output token ``C / K``; the prefill is the same for every shape and is left out. The best shape is
the one with the lowest ``C / K``. The marginal rule says the same thing one step at a time: growing a
shape (a longer chain, a deeper or wider tree) with deltas ``dC``, ``dK > 0`` pays exactly when
``dC / dK < C / K``, since then ``(C + dC) / (K + dK) < C / K``.

The bench writes its tuning result as a JSON file (``shapes.json``); ``eagle-tree decode mode=auto
shapes=PATH`` decodes with the shape selected there (:func:`load_tuned_shape`)::

    best = pick_best([ShapeMeasurement(TreeConfig.chain(3), round_s=0.030, committed=2.1), ...])
    tree = load_tuned_shape("results/bench/shapes.json")         # the overall best, chain or tree
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from eagle_tree.decoding.drafting import TreeConfig

SHAPES_FORMAT = "eagle-tree/shapes/v1"


def shape_name(tree: TreeConfig) -> str:
    """``chain-4`` or ``tree-d6k8n48`` (``-sampled`` appended for Gumbel-top-k trees)."""
    name = f"chain-{tree.depth}" if tree.is_chain else f"tree-d{tree.depth}k{tree.top_k}n{tree.total_tokens}"
    return name + ("-sampled" if tree.sampled else "")


@dataclass(frozen=True)
class ShapeMeasurement:
    """Per-round means of one draft shape: ``round_s`` = C (seconds), ``committed`` = K (tokens)."""

    tree: TreeConfig
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
        return shape_name(self.tree)

    @property
    def time_per_token(self) -> float:
        """C / K: seconds per committed token in steady state."""
        return self.round_s / self.committed

    def to_dict(self) -> dict:
        return {"name": self.name, "tree": asdict(self.tree), "round_s": self.round_s, "committed": self.committed,
                "rounds": self.rounds, "time_per_token_s": self.time_per_token}

    @classmethod
    def from_dict(cls, d: dict) -> ShapeMeasurement:
        return cls(TreeConfig(**d["tree"]), float(d["round_s"]), float(d["committed"]), int(d.get("rounds", 0)))


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
    """The shape with the lowest C / K; ties go to the smaller shape (fewer draft nodes), then the earlier."""
    if not measurements:
        raise ValueError("pick_best needs at least one measured shape")
    order = range(len(measurements))
    best = min(order, key=lambda i: (measurements[i].time_per_token, measurements[i].tree.total_tokens, i))
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
    """Measurements sorted by size: draft nodes, then depth, then top-k."""
    return sorted(measurements, key=lambda m: (m.tree.total_tokens, m.tree.depth, m.tree.top_k))


# ------------------------------------------------------------------------------- the tuning file


def selection(measurements: Sequence[ShapeMeasurement]) -> dict[str, ShapeMeasurement]:
    """The best chain, the best tree and the best of all (keys present only when measured)."""
    chosen = {"best": pick_best(measurements)}
    chains = [m for m in measurements if m.tree.is_chain]
    trees = [m for m in measurements if not m.tree.is_chain]
    if chains:
        chosen["chain"] = pick_best(chains)
    if trees:
        chosen["tree"] = pick_best(trees)
    return chosen


def save_tuned_shapes(path: str | Path, measurements: Sequence[ShapeMeasurement], **context) -> dict:
    """Write the measured shapes, the selection and the marginal tables to ``path`` (JSON); ``context``
    (e.g. the temperature, the prompt file, the machine) is stored alongside. Returns the written dict."""
    chosen = selection(measurements)
    chains = growth_order([m for m in measurements if m.tree.is_chain])
    trees = growth_order([m for m in measurements if not m.tree.is_chain])
    data = {
        "format": SHAPES_FORMAT,
        "criterion": "lowest C / K: mean round time over mean tokens committed per round",
        "selected": {kind: m.name for kind, m in chosen.items()},
        "shapes": [m.to_dict() for m in measurements],
        "marginal": {kind: [_step_dict(s) for s in marginal_steps(seq)] for kind, seq in (("chain", chains),
                                                                                           ("tree", trees))},
        "context": context,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, allow_nan=False))
    return data


def load_tuned_shape(path: str | Path, which: Literal["best", "chain", "tree"] = "best") -> TreeConfig:
    """The draft shape selected in a tuning file written by :func:`save_tuned_shapes` (``eagle-tree bench``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no tuning result at {str(path)!r}: run `eagle-tree bench` first (it writes shapes.json in its "
            "output folder) or point `shapes=` at its file"
        )
    data = json.loads(path.read_text())
    if data.get("format") != SHAPES_FORMAT:
        raise ValueError(f"{path} is not an eagle-tree shapes file (format {data.get('format')!r})")
    name = data["selected"].get(which)
    if name is None:
        raise ValueError(f"{path} selects no {which!r} shape; it has {sorted(data['selected'])}")
    by_name = {d["name"]: d for d in data["shapes"]}
    return TreeConfig(**by_name[name]["tree"])


def _step_dict(step: MarginalStep) -> dict:
    marginal = step.marginal_s
    return asdict(step) | {"marginal_s": marginal if math.isfinite(marginal) else None}
