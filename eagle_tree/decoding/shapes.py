"""A head's decoding defaults (``decoding.json``) and the shape a bench tuning file selected.

A head's folder can carry its decoding defaults in ``decoding.json`` (in the manner of
``generation_config.json``): the draft shape to use under greedy decoding and under sampling.
Training writes untuned defaults with the final head; the bench's tuning writes measured ones
(:func:`save_decoding_defaults`); ``SpeculativeDecoder(target, draft)`` without ``tree=`` reads them
(:func:`load_decoding_defaults`). ``eagle-tree decode mode=auto shapes=PATH`` decodes with the shape a
tuning file (``shapes.json``, written by ``eagle_tree.bench.tuning.save_tuned_shapes``) selected
(:func:`load_tuned_shape`). How shapes are chosen is ``eagle_tree/bench/tuning.py``.

Plain decoding (no draft) is a candidate of the tuning too, named :data:`NONE`: a tuning file may
select it and either entry of ``decoding.json`` may hold it (``{"tree": null, "name": "none", ...}``),
and both read back as ``None``, meaning "decode plainly", so a head's defaults can decline to speculate
where no draft shape pays.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.utils.atomic import write_text

SHAPES_FORMAT = "eagle-tree/shapes/v1"
DECODING_FORMAT = "eagle-tree/decoding/v1"
DECODING_FILE = "decoding.json"
NONE = "none"
"""The shape name of plain decoding (no draft): a tuning candidate and a decoding default."""


def load_tuned_shape(path: str | Path,
                     which: Literal["best", "chain", "tree", "context", "no_context", "context_only", "head_only_chain",
                                    "head_only_tree"] = "best"
                     ) -> TreeConfig | None:
    """The draft shape selected in a tuning file written by :func:`save_tuned_shapes` (``eagle-tree bench``);
    None where it selected plain decoding (:data:`NONE`, only ever as ``best``)."""
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
    tree = by_name[name]["tree"]
    return None if tree is None else TreeConfig(**tree)


# ------------------------------------------------------------------------- a head's decoding defaults


def save_decoding_defaults(folder: str | Path, tree: TreeConfig | None, greedy: bool, **source) -> dict:
    """Write ``tree`` as the default draft shape for greedy decoding (``greedy``) or for sampling into
    ``folder/decoding.json``, keeping the other entry if the file has one; ``tree`` None is plain
    decoding (``{"tree": null, "name": "none"}``: do not speculate). ``source`` (who measured it, on
    which prompts) is stored beside it. Returns the written dict."""
    path = Path(folder) / DECODING_FILE
    data = _read_decoding(path) or {"format": DECODING_FORMAT}
    entry = {"tree": None, "name": NONE} if tree is None else {"tree": asdict(tree), "name": tree.name}
    data["greedy" if greedy else "sampling"] = entry | {"source": source}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data, indent=2, allow_nan=False) + "\n")
    return data


def load_decoding_defaults(folder: str | Path | None) -> dict[str, TreeConfig | None]:
    """The draft shapes a head folder recommends: ``{"greedy": TreeConfig, "sampling": TreeConfig}``
    (either key absent when not set; empty when the folder has no decoding.json; a value None: plain
    decoding, the entry :data:`NONE`). Under sampling without a ``sampling`` entry the greedy one
    serves too, and vice versa (both are exact)."""
    data = _read_decoding(Path(folder) / DECODING_FILE) if folder is not None else None
    if not data:
        return {}
    out = {kind: None if data[kind]["tree"] is None else TreeConfig(**data[kind]["tree"])
           for kind in ("greedy", "sampling") if kind in data}
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
