"""``eagle-tree train``: train an EAGLE-3 draft head (TrainConfig, see docs/TRAINING.md).

    eagle-tree train --config configs/smoke.yaml output_dir=runs/smoke
    torchrun --nproc_per_node 2 -m eagle_tree.cli train --config configs/smoke.yaml cpu=true   # DDP on CPU
    accelerate launch --multi_gpu --num_processes 8 -m eagle_tree.cli train --config ...          # GPUs
"""

from __future__ import annotations

import sys

from eagle_tree.utils.config import parse_cli


def main(argv: list[str]) -> int:
    from eagle_tree.training.checkpoint import CheckpointWriteError
    from eagle_tree.training.config import TrainConfig
    from eagle_tree.training.data import DataError
    from eagle_tree.training.loop import TrainingDiverged, train
    from eagle_tree.training.rundir import RunFolderError
    from eagle_tree.utils.checks import InputError

    cfg = parse_cli(TrainConfig, argv, prog="eagle-tree train")
    try:
        result = train(cfg)
    except (RunFolderError, TrainingDiverged, CheckpointWriteError, DataError, InputError, FileNotFoundError) as exc:
        print(f"eagle-tree train: error: {exc}", file=sys.stderr)
        return 1
    if result.world_size == 1 or _is_main():
        print(f"[eagle-tree train] {result.steps} steps, {result.tokens} tokens in {result.wall_s:.1f} s; "
              f"head in {result.final_dir}")
        for ev in result.evals:
            print(f"[eagle-tree train] step {ev['step']}: acceptance length " + ", ".join(
                f"{m.replace('_', ' ')} {ev[f'acceptance_length_{m}']:.3f}" for m in ("chain", "tree", "copy_chain")
                if f"acceptance_length_{m}" in ev))
        if result.run_dir is not None:
            print(f"[eagle-tree train] W&B run: {result.run_dir}")
    return 0


def _is_main() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"
