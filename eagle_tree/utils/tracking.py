"""Weights & Biases logging with a lazy import: ``wandb`` loads only when a run is actually made.

    with RunLogger(cfg.wandb, run_config=config_to_dict(cfg), job_type="train") as logger:
        logger.log({"train/loss": 1.25, "train/acc_0": 0.5}, step=10)

Mode ``"auto"`` (the default) follows ``WANDB_MODE`` when it is set; otherwise it logs online when an
API key is configured (``WANDB_API_KEY``, or a ``.netrc`` entry for the W&B host) and offline when
not, so that machines without network or credentials still keep every run; upload later with
``wandb sync <run_dir>``. In ``"disabled"`` mode every method is a no-op and wandb is never imported.
The tests read offline runs back with their own reader (``tests/wandb_records.py``).
"""

from __future__ import annotations

import logging
import netrc
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

__all__ = ["WandbConfig", "RunLogger", "resolve_mode", "has_api_key"]

log = logging.getLogger(__name__)

Mode = Literal["auto", "online", "offline", "disabled"]


@dataclass
class WandbConfig:
    """Where and how a run is logged to Weights & Biases."""

    mode: Mode = "auto"
    """auto: WANDB_MODE if set, else online with an API key and offline without; or online, offline,
    disabled (no wandb at all)."""
    project: str = "eagle-tree"
    """W&B project name."""
    entity: str | None = None
    """W&B user or team (None: the account's default)."""
    name: str | None = None
    """Display name of the run (None: W&B picks one)."""
    dir: str | None = None
    """Folder under which W&B writes its ``wandb/`` run folders (None: WANDB_DIR, else the cwd)."""
    tags: list[str] = field(default_factory=list)
    """Tags attached to the run."""


def has_api_key() -> bool:
    """Whether W&B credentials are configured: ``WANDB_API_KEY`` or a netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def resolve_mode(mode: str) -> str:
    """``"auto"`` -> ``"online"``, ``"offline"`` or ``"disabled"``; other modes are returned as is."""
    if mode != "auto":
        if mode not in ("online", "offline", "disabled"):
            raise ValueError(f"unknown wandb mode {mode!r}; expected auto, online, offline or disabled")
        return mode
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    env = {"dryrun": "offline", "run": "online"}.get(env, env)
    if env in ("online", "offline", "disabled"):
        return env
    return "online" if has_api_key() else "offline"


def _to_list(values: Any) -> list:
    """A tensor, array or sequence as a flat Python list."""
    if hasattr(values, "detach"):  # torch.Tensor
        values = values.detach().float().cpu().numpy()
    if hasattr(values, "ravel"):  # numpy
        return values.ravel().tolist()
    return list(values)


class RunLogger:
    """One W&B run. Every method is a no-op when the resolved mode is ``"disabled"``.

    ``run_config`` (the resolved experiment config as a dict or dataclass) is stored as the run's
    config. ``run_dir`` is the local run folder holding the ``run-*.wandb`` file (None if disabled).
    """

    def __init__(
        self, cfg: WandbConfig, run_config: Mapping | Any | None = None, job_type: str | None = None
    ):
        self.cfg = cfg
        self.mode = resolve_mode(cfg.mode)
        self.run_dir: Path | None = None
        self._run = None
        if self.mode == "disabled":
            return
        import wandb

        from eagle_tree.utils.config import config_to_dict

        directory = cfg.dir or os.environ.get("WANDB_DIR") or None  # read now: wandb caches its setup
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name,
            dir=directory,
            tags=list(cfg.tags) or None,
            job_type=job_type,
            config=config_to_dict(run_config) if run_config is not None else None,
            mode=self.mode,
            settings=wandb.Settings(silent=True, console="off", reinit="create_new"),
        )
        self.run_dir = Path(self._run.settings.sync_dir)

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Scalars (or any wandb value) under their keys, e.g. ``{"train/loss": 1.2}``."""
        if self._run is not None:
            self._run.log(dict(metrics), step=step)

    def log_histogram(self, key: str, values: Any, step: int | None = None, num_bins: int = 64) -> None:
        """A histogram of ``values`` (a sequence, array or tensor)."""
        if self._run is not None:
            hist = self._wandb.Histogram(_to_list(values), num_bins=num_bins)
            self._run.log({key: hist}, step=step)

    def log_line(
        self,
        key: str,
        xs: Sequence[float],
        ys: Sequence[float],
        title: str = "",
        x_name: str = "x",
        y_name: str = "y",
        step: int | None = None,
    ) -> None:
        """A line plot of ``ys`` against ``xs`` (e.g. a survival curve), logged as ``{key}_table``."""
        if self._run is not None:
            xs, ys = _to_list(xs), _to_list(ys)
            if len(xs) != len(ys):
                raise ValueError(f"log_line({key!r}): {len(xs)} xs but {len(ys)} ys")
            rows = [[x, y] for x, y in zip(xs, ys, strict=True)]
            table = self._wandb.Table(columns=[x_name, y_name], data=rows)
            plot = self._wandb.plot.line(table, x_name, y_name, title=title or key)
            self._run.log({key: plot}, step=step)

    def log_image(
        self, key: str, path: str | Path, step: int | None = None, caption: str | None = None
    ) -> None:
        """An image file (png, jpg...), e.g. a figure saved by matplotlib."""
        if self._run is not None:
            self._run.log({key: self._wandb.Image(str(path), caption=caption)}, step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Set run summary values (the single numbers shown in the runs table)."""
        if self._run is not None:
            for key, value in values.items():
                self._run.summary[key] = value

    def log_artifact(
        self, path: str | Path, name: str, type: str, metadata: Mapping[str, Any] | None = None
    ) -> None:
        """A file or folder as a versioned artifact; offline it is recorded and uploaded on sync."""
        if self._run is None:
            return
        path = Path(path)
        artifact = self._wandb.Artifact(name, type=type, metadata=dict(metadata or {}))
        if path.is_dir():  # file by file: add_dir prints a progress line
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                artifact.add_file(str(file), name=file.relative_to(path).as_posix())
        elif path.is_file():
            artifact.add_file(str(path))
        else:
            raise FileNotFoundError(f"log_artifact({name!r}): no file or folder at {path}")
        self._run.log_artifact(artifact)

    def finish(self, exit_code: int | None = None) -> None:
        """End the run (idempotent); offline runs are then complete on disk."""
        if self._run is not None:
            run, self._run = self._run, None
            run.finish(exit_code=exit_code)
            if self.mode == "offline":
                log.info("wandb offline run in %s; upload with `wandb sync %s`", self.run_dir, self.run_dir)

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exit_code=1 if exc_type is not None else None)
