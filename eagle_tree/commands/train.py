"""``eagle-tree train``: train an EAGLE-3 draft head (TrainConfig, see docs/TRAINING.md).

    eagle-tree train --config configs/smoke.yaml output_dir=runs/smoke
    torchrun --nproc_per_node 2 -m eagle_tree.cli train --config configs/smoke.yaml cpu=true   # DDP on CPU
    accelerate launch --multi_gpu --num_processes 8 -m eagle_tree.cli train --config ...          # GPUs
"""

from __future__ import annotations

import contextlib
import signal
import sys

from eagle_tree.utils.config import parse_cli

PROG = "eagle-tree train"


def main(argv: list[str]) -> int:
    from eagle_tree.data.rows import DataError
    from eagle_tree.training.checkpoint import CheckpointWriteError
    from eagle_tree.training.config import TrainConfig
    from eagle_tree.training.loop import TrainingDiverged
    from eagle_tree.training.rundir import RunFolderError
    from eagle_tree.utils.checks import exit_on_input_error

    cfg = parse_cli(TrainConfig, argv, prog=PROG)
    ignored = ignored_step_override(cfg, argv)
    if ignored:
        print(f"usage: {PROG} [--config FILE] [key=value ...]\n{PROG}: error: {ignored}", file=sys.stderr)
        return 2
    anticipated = (RunFolderError, TrainingDiverged, CheckpointWriteError, DataError, FileNotFoundError)
    with _sigterm_as_interrupt():
        return exit_on_input_error(PROG, run, cfg, anticipated, interrupted=lambda: _what_was_saved(cfg, argv))


def ignored_step_override(cfg, argv: list[str]) -> str | None:
    """The problem when the command line sets ``schedule.max_steps`` but ``schedule.epochs`` or
    ``schedule.max_minutes`` (from the config file, say) sets the step count instead; None otherwise."""
    given = [a for a in argv if a.partition("=")[0] == "schedule.max_steps"]
    s = cfg.schedule
    setter = next(((k, v) for k, v in (("max_minutes", s.max_minutes), ("epochs", s.epochs)) if v is not None), None)
    if not given or setter is None:
        return None
    key, value = setter
    return (f"{given[-1]} would have no effect: schedule.{key}={value} sets the step count; add "
            f"schedule.{key}=null to train for schedule.max_steps steps")


def run(cfg) -> int:
    from eagle_tree.training.loop import train

    result = train(cfg)
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


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (a scheduler stopping the job) ends the run as Ctrl-C does: the lock is released and one
    line says what was saved."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _what_was_saved(cfg, argv: list[str]) -> str:
    """The newest checkpoint of the run and the command that continues from it."""
    import shlex

    from eagle_tree.training.checkpoint import latest_checkpoint

    last = latest_checkpoint(cfg.output_dir)
    if last is None:
        return (f"no checkpoint was written yet under {cfg.output_dir}/checkpoints (checkpoint.every sets how "
                "often); rerun the same command to start again")
    kept = [a for a in argv if not a.startswith(("resume=", "overwrite="))]
    again = " ".join(shlex.quote(a) for a in [*PROG.split(), *kept, "resume=latest"])
    return f"the last checkpoint is {last}; continue from it with: {again}"


def _is_main() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"
