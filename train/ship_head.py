"""Copy a trained head into the repository in a smaller precision (every file under 25 MB).

    python train/ship_head.py src=runs/smollm2/head/final dst=assets/smollm2/head dtype=bfloat16

Floating-point weights are rounded to ``dtype`` (the vocabulary maps stay integers); loading casts
them back to the dtype asked for, so the shipped head *is* the rounded one and every figure is
measured on it. The training config and the run's evaluations are copied beside the weights.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from eagle_tree.utils.atomic import atomic_dir
from eagle_tree.utils.config import parse_cli

LIMIT = 25 * 2**20


@dataclass
class ShipConfig:
    """Round a head's weights to a smaller precision and copy it with its training record."""

    src: str = "runs/smollm2/head/final"
    """the trained head folder (config.json, model.safetensors)"""
    dst: str = "assets/smollm2/head"
    """where the shipped head goes (replaced as a whole)"""
    dtype: str = "bfloat16"
    """precision of the floating-point weights"""
    run_dir: str | None = "runs/smollm2/head"
    """the training run folder whose config.yaml and train_summary.json are copied (null: none)"""


def main(argv: list[str]) -> int:
    cfg = parse_cli(ShipConfig, argv, prog="python train/ship_head.py")
    src, dst, dtype = Path(cfg.src), Path(cfg.dst), getattr(torch, cfg.dtype)
    state = load_file(src / "model.safetensors")
    rounded = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    weights = save(rounded, metadata={"format": "pt", "dtype": cfg.dtype})
    run = Path(cfg.run_dir) if cfg.run_dir else None
    copies = {src / "config.json": "config.json"}
    if run:
        copies |= {run / n: out for n, out in (("config.yaml", "train-config.yaml"),
                                               ("train_summary.json", "train_summary.json")) if (run / n).is_file()}
    if (dst / "decoding.json").is_file():  # tuned defaults survive a reship
        copies[dst / "decoding.json"] = "decoding.json"
    sizes = {"model.safetensors": len(weights)} | {out: p.stat().st_size for p, out in copies.items()}
    big = [name for name, size in sizes.items() if size > LIMIT]
    if big:  # refused before anything is written: the shipped head stays as it was
        print(f"ship_head: {big} over 25 MB in {cfg.dtype}; use a smaller dtype or draft vocabulary", file=sys.stderr)
        return 2
    with atomic_dir(dst) as tmp:  # the old folder stays whole until the new one is complete
        (tmp / "model.safetensors").write_bytes(weights)
        for p, out in copies.items():
            shutil.copy(p, tmp / out)
    print(json.dumps({"dst": str(dst), "dtype": cfg.dtype, "bytes": sizes}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
