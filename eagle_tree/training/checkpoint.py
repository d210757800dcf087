"""Checkpoint I/O of a training run: OUTPUT_DIR/checkpoints/step-N holds the head in the EAGLE-3 layout
(config.json, model.safetensors), ``training_state.pt`` (optimiser, schedule, RNG states, data position,
run id) and config.yaml. Save (atomic), load, latest, prune (this run's checkpoints only).

Nothing in a checkpoint can run code when it is read: the head is safetensors, the training state holds
tensors, numbers, strings, lists and dicts only (the numpy RNG state as a list) and is read by
``eagle_tree.utils.statefile.read_state`` (``torch.load(weights_only=True)``); a file holding anything
else is refused with a :class:`StateFileError` naming it, before any of it is used."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from eagle_tree.training.config import TrainConfig
from eagle_tree.utils.statefile import StateFileError, read_state

STATE_NAME = "training_state.pt"
CONFIG_NAME = "config.yaml"
RUN_ID_NAME = "run_id"  # beside training_state.pt: the id of the run that wrote the checkpoint

__all__ = ["STATE_NAME", "CONFIG_NAME", "checkpoint_dirs", "latest_checkpoint", "checkpoint_run_id", "full_head",
           "gather_object", "save_checkpoint", "read_training_state", "load_training_state", "prune_checkpoints",
           "CheckpointWriteError"]


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, permissions); the earlier checkpoints are intact."""


def checkpoint_dirs(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``output_dir/checkpoints``, oldest first."""
    root = Path(output_dir) / "checkpoints"
    found = []
    for p in root.glob("step-*") if root.is_dir() else []:
        if p.is_dir() and p.name[5:].isdigit() and (p / STATE_NAME).is_file():
            found.append((int(p.name[5:]), p))
    return sorted(found)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``output_dir/checkpoints``, or None."""
    found = checkpoint_dirs(output_dir)
    return found[-1][1] if found else None


def checkpoint_run_id(ckpt: Path) -> str | None:
    """The run id a checkpoint was written by (None: written before runs had ids)."""
    path = ckpt / RUN_ID_NAME
    if path.is_file():
        return path.read_text().strip() or None
    if not (ckpt / STATE_NAME).is_file():
        return None
    try:  # the run_id file was lost: the training state records the id too
        run_id = read_state(ckpt / STATE_NAME).get("run_id")
    except StateFileError:
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def gather_object(acc, obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
    if acc.num_processes == 1:
        return [obj]
    from accelerate.utils import gather_object as gather

    return list(gather([obj]))


def _rng_state() -> dict:
    """The RNG states in types ``weights_only`` reads: numpy's key as a list of ints."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
            "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(_as_tuples(state["python"]))


def _as_tuples(state):
    """random.getstate() nests tuples; a reader may hand back lists."""
    return tuple(_as_tuples(x) for x in state) if isinstance(state, list | tuple) else state


def full_head(draft, weights: dict):
    """A CPU copy of the head holding ``weights`` (the full state dict of the training module, keys
    ``draft.*``, which FSDP gathers): what checkpoints, the final folder and evaluation use."""
    from eagle_tree.models.head import Eagle3DraftModel

    state = {k.removeprefix("draft."): v.detach().cpu() for k, v in weights.items()}
    return Eagle3DraftModel.from_state_dict(draft.config, state)


def save_checkpoint(acc, cfg: TrainConfig, module, draft, optimizer, scheduler, progress: dict, step: int,
                    run_id: str) -> Path:
    """Atomically write OUTPUT_DIR/checkpoints/step-N, built in a hidden folder unique to this run's main
    process and renamed into place. Every process takes part (gathers); the main process writes. A write
    error (full disk) raises CheckpointWriteError naming the folder and the free space."""
    from eagle_tree.utils.atomic import atomic_dir
    from eagle_tree.utils.config import save_config

    rng = gather_object(acc, _rng_state())
    from eagle_tree.training.sharding import full_state_dict, is_sharded

    weights = full_state_dict(acc, module)  # the full state dict on the main process (FSDP gathers)
    sharded = is_sharded(acc, module)
    root = Path(cfg.output_dir) / "checkpoints"
    final = root / f"step-{step}"
    try:
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(atomic_dir(final)) if acc.is_main_process else None
            if sharded and acc.num_processes > 1:  # the ranks write into the main process's folder
                tmp = Path(gather_object(acc, str(tmp))[0])
            if acc.is_main_process:
                full_head(draft, weights).save_pretrained(tmp)  # config.json + model.safetensors
            acc.wait_for_everyone()
            if sharded:  # FSDP: every rank keeps its own optimiser shard
                torch.save(optimizer.state_dict(), tmp / f"optimizer-rank{acc.process_index}.pt")
                acc.wait_for_everyone()
            if acc.is_main_process:
                state = {
                    "step": step, "progress": progress, "scheduler": scheduler.state_dict(),
                    "optimizer": None if sharded else optimizer.state_dict(), "rng": rng,
                    "world_size": acc.num_processes, "draft_ids": draft.draft_to_target.tolist(), "run_id": run_id,
                }
                torch.save(state, tmp / STATE_NAME)
                save_config(cfg, tmp / CONFIG_NAME)
                (tmp / RUN_ID_NAME).write_text(run_id + "\n")
    except (OSError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not _is_write_error(exc):
            raise
        free = shutil.disk_usage(root if root.exists() else Path(cfg.output_dir)).free
        raise CheckpointWriteError(
            f"could not write the checkpoint of step {step} to {final}: {exc.__class__.__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}; {free / 2**20:.0f} MiB free in {root}. "
            "The earlier checkpoints are intact: free some space (or set output_dir elsewhere) and rerun "
            "with resume=latest") from exc
    acc.wait_for_everyone()
    return final


def _is_write_error(exc: RuntimeError) -> bool:
    """torch.save reports a failed write (ENOSPC...) as a RuntimeError from its zip writer."""
    text = str(exc)
    return any(s in text for s in ("inline_container", "file write failed", "No space left", "PytorchStreamWriter"))


def prune_checkpoints(output_dir: str | os.PathLike, keep_last: int | None, run_id: str) -> list[Path]:
    """Delete this run's checkpoints but the newest ``keep_last`` >= 1 (None: keep all); checkpoints written
    by other runs are never considered. Returns the deleted folders."""
    if keep_last is None:
        return []
    mine = [p for _, p in checkpoint_dirs(output_dir) if checkpoint_run_id(p) == run_id]
    gone = mine[:-keep_last]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def read_training_state(ckpt: Path, rank: int = 0) -> tuple[dict, dict | None]:
    """(training state, this rank's optimiser shard or None) of ``ckpt``, read safely and checked for the
    keys a training state has, before anything of the run is touched (StateFileError otherwise)."""
    state = read_state(ckpt / STATE_NAME)
    missing = [k for k in ("step", "progress", "scheduler", "optimizer", "rng") if k not in state]
    if missing:
        raise StateFileError(f"{ckpt / STATE_NAME} lacks {', '.join(missing)}: it is not a training state "
                             "written by eagle-tree train; resume from another checkpoint or start a new run")
    shard = None
    if state["optimizer"] is None:
        path = ckpt / f"optimizer-rank{rank}.pt"
        if not path.is_file():
            raise StateFileError(f"{ckpt} holds no {path.name} (the optimiser shard of rank {rank}): resume with "
                                 "the number of processes that wrote it")
        shard = read_state(path, "optimiser shard")
    return state, shard


def load_training_state(acc, ckpt: Path, optimizer, scheduler, read: tuple[dict, dict | None] | None = None) -> dict:
    """Restore optimiser, schedule and RNG states from ``ckpt`` (or from ``read``, what
    :func:`read_training_state` returned for it); returns the whole training state."""
    state, shard = read if read is not None else read_training_state(ckpt, acc.process_index)
    optimizer.load_state_dict(state["optimizer"] if shard is None else shard)
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    _set_rng_state(rng[acc.process_index] if len(rng) == acc.num_processes else rng[0])
    return state
