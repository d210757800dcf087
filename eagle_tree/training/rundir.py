"""One run per output folder. A run records its identity in OUTPUT_DIR/run.json (run id, config hash,
seed, start time) and every checkpoint it writes carries the run id. Rules:

- a fresh run refuses a folder that holds another run's checkpoints or final head, unless ``resume`` is
  set or ``overwrite=true`` (which deletes that run's checkpoints, final head, summary and identity; other
  files are kept);
- ``resume`` compares the checkpoint's config with the new one and lists every changed key with whether
  it takes effect; changes that cannot take effect (data, target, head, optimiser hyper-parameters kept in
  the optimiser state, batch size, seed, a ``schedule.max_steps`` below the checkpoint's step) are refused;
- a lock (an ``flock`` on OUTPUT_DIR/train.lock, through ``filelock``) stops a second writer; the kernel
  releases it when the writer ends, however it ends.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml
from filelock import FileLock, Timeout

from eagle_tree.training.checkpoint import CONFIG_NAME, checkpoint_dirs, checkpoint_run_id
from eagle_tree.utils.atomic import write_text

RUN_FILE = "run.json"
LOCK_FILE = "train.lock"
WRITTEN = ("checkpoints", "final", "train_summary.json", RUN_FILE, CONFIG_NAME)  # what overwrite=true deletes

# keys whose change on resume has no effect on the trained head
NEUTRAL = ("output_dir", "resume", "overwrite", "progress", "threads", "log_every", "wandb.")
# keys whose new value cannot take effect on resume (prefixes); every other key takes effect
FROZEN = {
    "target.": "the checkpoint's head belongs to its target",
    "data.": "the data, its tokenisation and the draft vocabulary are fixed by the checkpoint",
    "model.": "the head's weights come from the checkpoint",
    "optim.lr": "the optimiser state holds the learning rate",
    "optim.betas": "the optimiser state holds the betas",
    "optim.eps": "the optimiser state holds eps",
    "optim.weight_decay": "the optimiser state holds the weight decay",
    "optim.batch_size": "the saved data position counts batches of the old size",
    "seed": "the data order is fixed by the seed",
    "features.": "the feature cache is fingerprinted with the old settings",
}

# keys added after runs were checkpointed, with the value that reproduces what those runs did: a saved config
# without the key reads as holding it, so such runs resume
ADDED = {"data.length_grouping": 0}

__all__ = ["RunIdentity", "RunFolderError", "claim_output_dir", "resume_changes", "RunLock", "config_hash"]


class RunFolderError(RuntimeError):
    """The output folder belongs to another run, is being written by another process, or a resume
    asks for changes that cannot take effect."""


@dataclass
class RunIdentity:
    run_id: str
    config_hash: str
    seed: int
    started: str

    def write(self, out_dir: Path) -> None:
        write_text(out_dir / RUN_FILE, json.dumps(self.__dict__, indent=1) + "\n")

    @classmethod
    def read(cls, out_dir: Path) -> RunIdentity | None:
        """The identity in ``out_dir/run.json`` (None: no such file); a file that is not a run identity
        (broken JSON, another program's file) is a RunFolderError naming it."""
        path = out_dir / RUN_FILE
        if not path.is_file():
            return None
        keys = ("run_id", "config_hash", "seed", "started")
        try:
            data = json.loads(path.read_text())
            ident = cls(**{k: data[k] for k in keys})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            reason = f"no key {exc}" if isinstance(exc, KeyError) else f"{exc.__class__.__name__}: {exc}"
            raise RunFolderError(
                f"{path} is not the run identity eagle-tree train writes ({reason}; expected a JSON object with "
                f"{', '.join(keys)}): choose another output_dir, or pass overwrite=true to replace it and start a "
                "new run there") from None
        if not isinstance(ident.run_id, str) or not ident.run_id:
            raise RunFolderError(f"{path} names no run id (run_id={ident.run_id!r}): choose another output_dir, or "
                                 "pass overwrite=true to start a new run there")
        return ident


def _flat(data, prefix: str = "") -> dict:
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def config_hash(cfg) -> str:
    """sha256 (16 hex) of the settings that shape the trained head (neutral keys left out)."""
    from eagle_tree.utils.config import config_to_dict

    flat = {k: v for k, v in _flat(config_to_dict(cfg)).items() if not k.startswith(NEUTRAL)}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _holds_a_run(out_dir: Path) -> bool:
    return bool(checkpoint_dirs(out_dir)) or (out_dir / "final").exists()


def _read_identity(out_dir: Path, overwrite: bool) -> RunIdentity | None:
    try:
        return RunIdentity.read(out_dir)
    except RunFolderError:
        if overwrite:
            return None  # replaced below, as the user asked
        raise


def check_inputs_apart(cfg) -> None:
    """Refuse a run whose inputs (data files, model.init_from, prompt files) are files it writes: the run
    would replace what it reads (always refused, also with overwrite=true)."""
    out_dir = Path(cfg.output_dir).resolve()
    written = [out_dir / name for name in WRITTEN]
    inputs = {"model.init_from": cfg.model.init_from, "eval.prompts": cfg.eval.prompts,
              "eval.copy_prompts": cfg.eval.copy_prompts}
    paths = cfg.data.path if isinstance(cfg.data.path, list | tuple) else [cfg.data.path]
    inputs |= {f"data.path[{i}]" if len(paths) > 1 else "data.path": p for i, p in enumerate(paths)}
    fresh = cfg.resume is None
    for key, value in inputs.items():
        if not isinstance(value, str) or not Path(value).expanduser().exists():
            continue
        path = Path(value).expanduser().resolve()
        hit = next((w for w in written if path == w or w in path.parents), None)
        if hit is None or (key == "model.init_from" and not fresh):
            continue
        raise RunFolderError(f"{key}={value} is {'inside ' if path != hit else ''}{hit}, which this run writes "
                             f"into output_dir {cfg.output_dir}: it would replace what it reads; copy it elsewhere "
                             "or choose another output_dir")


def _unowned_files(out_dir: Path, old: RunIdentity | None) -> list[str]:
    """The files a run writes at the top of ``out_dir`` that exist there without a run identity: the user's."""
    if old is not None:
        return []
    return [name for name in (CONFIG_NAME, "train_summary.json") if (out_dir / name).exists()]


def claim_output_dir(cfg, resume_from: Path | None) -> RunIdentity:
    """The identity of this run in ``cfg.output_dir``: the resumed run's, or a new one (after the checks
    and, with ``overwrite``, the removal of the old run's outputs); written to run.json. A fresh run also
    refuses a folder holding a config.yaml or train_summary.json that no training wrote (no run.json)."""
    out_dir = Path(cfg.output_dir)
    check_inputs_apart(cfg)
    overwrite = bool(getattr(cfg, "overwrite", False))
    old = _read_identity(out_dir, overwrite)
    if resume_from is not None:
        ckpt_run = checkpoint_run_id(resume_from)
        inside = resume_from.resolve().parent.parent == out_dir.resolve()
        if inside and old is not None and ckpt_run is not None and ckpt_run != old.run_id:
            raise RunFolderError(
                f"checkpoint {resume_from} was written by run {ckpt_run}, but {out_dir / RUN_FILE} names run "
                f"{old.run_id}: the folder mixes two runs; resume from an explicit checkpoint of one of them in a "
                "fresh output_dir")
        if inside and ckpt_run is not None:
            ident = RunIdentity(ckpt_run, config_hash(cfg), cfg.seed, old.started if old else _now())
            ident.write(out_dir)
            return ident
        if not inside and _holds_a_run(out_dir):
            raise RunFolderError(
                f"resume={resume_from} continues a checkpoint of another folder, but output_dir {out_dir} holds "
                "the checkpoints or final head of another run; give a fresh output_dir")
    elif _unowned_files(out_dir, old) and not overwrite and not _holds_a_run(out_dir):
        unowned = _unowned_files(out_dir, old)
        raise RunFolderError(
            f"output_dir {out_dir} holds {' and '.join(unowned)} that no training wrote there (no {RUN_FILE}): "
            f"training would replace {'them' if len(unowned) > 1 else 'it'}; choose another output_dir, or pass "
            "overwrite=true to replace them")
    elif _holds_a_run(out_dir):
        who = f"run {old.run_id} (started {old.started})" if old else "an earlier run"
        if not overwrite:
            hint = ("it has no checkpoint to resume from" if cfg.resume is not None
                    else "continue it with resume=latest")
            raise RunFolderError(
                f"output_dir {out_dir} holds the checkpoints or final head of {who}: {hint}, choose another "
                "output_dir, or pass overwrite=true to delete that run's checkpoints, final head and summary and "
                "start a new run there")
        for name in WRITTEN:
            path = out_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        print(f"[eagle-tree train] overwrite=true: removed the outputs of {who} from {out_dir}", flush=True)
    ident = RunIdentity(uuid.uuid4().hex[:12], config_hash(cfg), cfg.seed, _now())
    ident.write(out_dir)
    return ident


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def resume_changes(cfg, ckpt: Path, ckpt_step: int) -> list[str]:
    """Report the settings that differ between checkpoint ``ckpt`` and ``cfg``: one line per changed key
    with whether it takes effect. Raises RunFolderError listing the changes that cannot take effect."""
    from eagle_tree.utils.config import ConfigError, config_to_dict, read_yaml

    path = ckpt / CONFIG_NAME
    if not path.is_file():
        return [f"{ckpt} holds no {CONFIG_NAME}: changed settings cannot be checked"]
    try:
        saved = read_yaml(path.read_text())
    except (OSError, UnicodeDecodeError, ConfigError, yaml.YAMLError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise RunFolderError(f"{path} is not a config eagle-tree train wrote ({reason}): resume from another "
                             "checkpoint, or start a new run") from None
    if not isinstance(saved, dict | None):
        raise RunFolderError(f"{path} holds a {type(saved).__name__}, not a config: resume from another checkpoint")
    before = _flat(saved or {})
    for key, value in ADDED.items():
        before.setdefault(key, value)
    after = _flat(json.loads(json.dumps(config_to_dict(cfg), default=str)))
    lines, refused = [], []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if _same(a, b) or key.startswith(NEUTRAL):
            continue
        reason = next((why for prefix, why in FROZEN.items() if key == prefix or key.startswith(prefix)), None)
        if reason is not None:
            refused.append(f"  {key}: {a!r} -> {b!r} cannot take effect ({reason})")
        else:
            lines.append(f"  {key}: {a!r} -> {b!r} takes effect from step {ckpt_step}")
    if cfg.schedule.epochs is None and cfg.schedule.max_minutes is None and cfg.schedule.max_steps < ckpt_step:
        refused.append(f"  schedule.max_steps={cfg.schedule.max_steps} is below the checkpoint's step {ckpt_step}")
    if refused:
        raise RunFolderError(
            f"resume from {ckpt} refused: these settings differ from the checkpoint's and cannot take effect:\n"
            + "\n".join(refused)
            + "\nUse the checkpoint's values (its config.yaml), or start a new run in another output_dir "
              "(model.init_from=CHECKPOINT keeps the weights)")
    return lines


def _same(a, b) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


class RunLock:
    """OUTPUT_DIR/train.lock, held with an exclusive ``flock`` (``filelock``) while a training writes to the
    folder. The kernel releases it when the process ends, however it ends (a kill included), so there is no
    stale lock to take over; the empty file stays in the folder."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / LOCK_FILE
        self._lock = FileLock(self.path, timeout=0)

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except Timeout:
            raise RunFolderError(f"another training is writing to {self.path.parent} (it holds {self.path}); wait "
                                 "for it to end or choose another output_dir") from None
        return self

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release(force=True)
