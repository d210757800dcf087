"""Choosing the draft shape from measurements (docs/MEASURING.md, "The bench", step 4).

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

Context branches (``TreeConfig.context``) are tuned the same way: a shape with context is one more
candidate, named ``chain-4+ctx8`` (``+ctx8x2`` for two branches; ``TreeConfig.name``). The marginal tables follow each
context setting's own growth sequence.

A head's folder can carry its decoding defaults in ``decoding.json`` (in the manner of
``generation_config.json``): the draft shape to use under greedy decoding and under sampling.
Training writes untuned defaults with the final head; the bench's tuning writes measured ones
(:func:`save_decoding_defaults`); ``SpeculativeDecoder(target, draft)`` without ``tree=`` reads them
(:func:`load_decoding_defaults`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.utils.atomic import write_text

SHAPES_FORMAT = "eagle-tree/shapes/v1"
DECODING_FORMAT = "eagle-tree/decoding/v1"
DECODING_FILE = "decoding.json"


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
        return self.tree.name

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
    """The best chain, the best tree and the best of all; when context settings were measured, also
    the best shape without context (``no_context``) and with it (``context``). Keys present only when
    measured."""
    chosen = {"best": pick_best(measurements)}
    groups = {
        "chain": [m for m in measurements if m.tree.is_chain],
        "tree": [m for m in measurements if not m.tree.is_chain],
        "no_context": [m for m in measurements if m.tree.context is None],
        "context": [m for m in measurements if m.tree.context is not None],
    }
    if not groups["context"]:
        del groups["no_context"]
    for kind, group in groups.items():
        if group:
            chosen[kind] = pick_best(group)
    return chosen


def _growth_sequences(measurements: Sequence[ShapeMeasurement]) -> dict[str, list[ShapeMeasurement]]:
    """Chains and trees, each context setting apart: ``chain``, ``tree``, ``chain+ctx8``, ..."""
    sequences: dict[str, list[ShapeMeasurement]] = {"chain": [], "tree": []}
    for m in measurements:
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


def load_tuned_shape(path: str | Path,
                     which: Literal["best", "chain", "tree", "context", "no_context"] = "best") -> TreeConfig:
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


# ------------------------------------------------------------------------- a head's decoding defaults


def save_decoding_defaults(folder: str | Path, tree: TreeConfig, greedy: bool, **source) -> dict:
    """Write ``tree`` as the default draft shape for greedy decoding (``greedy``) or for sampling into
    ``folder/decoding.json``, keeping the other entry if the file has one; ``source`` (who measured it,
    on which prompts) is stored beside it. Returns the written dict."""
    path = Path(folder) / DECODING_FILE
    data = _read_decoding(path) or {"format": DECODING_FORMAT}
    data["greedy" if greedy else "sampling"] = {"tree": asdict(tree), "name": tree.name, "source": source}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data, indent=2, allow_nan=False) + "\n")
    return data


def load_decoding_defaults(folder: str | Path | None) -> dict[str, TreeConfig]:
    """The draft shapes a head folder recommends: ``{"greedy": TreeConfig, "sampling": TreeConfig}``
    (either key absent when not set; empty when the folder has no decoding.json). Under sampling
    without a ``sampling`` entry the greedy one serves too, and vice versa (both are exact)."""
    data = _read_decoding(Path(folder) / DECODING_FILE) if folder is not None else None
    if not data:
        return {}
    out = {kind: TreeConfig(**data[kind]["tree"]) for kind in ("greedy", "sampling") if kind in data}
    if out and len(out) == 1:
        (only,) = out.values()
        out = {"greedy": only, "sampling": only}
    return out


def is_decoding_file(path: str | Path) -> bool:
    """Whether ``path`` is an eagle-tree decoding defaults file (which the bench's tuning may update)."""
    try:
        return json.loads(Path(path).read_text()).get("format") == DECODING_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _read_decoding(path: Path) -> dict | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("format") != DECODING_FORMAT:
        raise ValueError(f"{path} is not an eagle-tree decoding defaults file (format {data.get('format')!r}); "
                         f"expected {DECODING_FORMAT!r}: remove it or rewrite it with the bench's tuning")
    return data
