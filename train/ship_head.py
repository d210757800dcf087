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
from safetensors.torch import load_file, save_file

from eagle_tree.utils.atomic import atomic_dir
from eagle_tree.utils.config import parse_cli

LIMIT = 25 * 2**20


class _TooBig(Exception):
    """A shipped file would exceed LIMIT: nothing is written."""


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
    try:
        _write(cfg, src, dst, rounded)
    except _TooBig:
        return 2
    sizes = {p.name: p.stat().st_size for p in dst.iterdir()}
    print(json.dumps({"dst": str(dst), "dtype": cfg.dtype, "bytes": sizes}, indent=2))
    return 0


def _write(cfg: ShipConfig, src: Path, dst: Path, rounded: dict) -> None:
    with atomic_dir(dst) as tmp:  # the old folder stays whole until the new one is complete
        save_file(rounded, str(tmp / "model.safetensors"), metadata={"format": "pt", "dtype": cfg.dtype})
        shutil.copy(src / "config.json", tmp / "config.json")
        if cfg.run_dir:
            run = Path(cfg.run_dir)
            for name, out in (("config.yaml", "train-config.yaml"), ("train_summary.json", "train_summary.json")):
                if (run / name).is_file():
                    shutil.copy(run / name, tmp / out)
        if (dst / "decoding.json").is_file():  # tuned defaults survive a reship
            shutil.copy(dst / "decoding.json", tmp / "decoding.json")
        big = [p.name for p in tmp.iterdir() if p.stat().st_size > LIMIT]
        if big:
            print(f"ship_head: {big} over 25 MB in {cfg.dtype}; use a smaller dtype or draft vocabulary",
                  file=sys.stderr)
            raise _TooBig


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
