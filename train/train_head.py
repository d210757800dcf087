"""Train an EAGLE-3 draft head from a YAML config (the library does the work; see docs/TRAINING.md).

    python train/train_head.py --config configs/smoke.yaml output_dir=runs/smoke
    python train/train_head.py --config configs/train-reference.yaml resume=latest
    torchrun --nproc_per_node 2 train/train_head.py --config configs/smoke.yaml cpu=true     # DDP on CPU
    accelerate launch --multi_gpu --num_processes 8 train/train_head.py --config ...           # GPUs

Equivalent to ``eagle-tree train``; kept as a recipe to copy when a run needs its own twist.
"""

from __future__ import annotations

import sys

from eagle_tree.training.config import TrainConfig
from eagle_tree.training.loop import train
from eagle_tree.utils.config import parse_cli


def main(argv: list[str] | None = None) -> None:
    cfg = parse_cli(TrainConfig, sys.argv[1:] if argv is None else argv, prog="train_head.py")
    result = train(cfg)
    if result.evals:
        last = result.evals[-1]
        print(f"step {last['step']}: acceptance length chain {last['acceptance_length_chain']:.3f}, "
              f"tree {last['acceptance_length_tree']:.3f}")
    print(f"{result.steps} steps in {result.wall_s:.1f} s; head in {result.final_dir}")


if __name__ == "__main__":
    main()
