"""A test oracle: read an offline W&B run back from its ``run-<id>.wandb`` file, to prove what was logged.

    run = read_run(logger.run_dir)
    assert [row["train/loss"] for row in run.history if "train/loss" in row] == [1.25, 1.0]

The file (wandb 0.31, written by ``wandb-core``) is a LevelDB-log-style record file:

* a 7-byte file header: ``b":W&B"``, magic ``0xBEE1`` (uint16 little endian: ``e1 be``), version 0;
* then 32 KiB blocks counted from the start of the file (the header sits inside block 0, which
  therefore holds at most 32768 - 7 bytes of chunks). A block is a run of chunks: a 7-byte chunk
  header (CRC, uint32 LE; payload length, uint16 LE; type, 1 byte: FULL=1, FIRST=2, MIDDLE=3,
  LAST=4) then the payload. A chunk never crosses a block; fewer than 7 bytes left in a block are
  zero padding, and an all-zero chunk header means the rest of the block is unused.
* The CRC is the plain CRC-32 (IEEE, ``zlib.crc32``) of the type byte followed by the payload,
  unmasked; W&B does not use LevelDB's masked CRC-32C.
* A record is the concatenation of a FULL chunk, or of FIRST, MIDDLE..., LAST chunks; its bytes are a
  serialized ``wandb.proto.wandb_internal_pb2.Record``, whose ``record_type`` is e.g. ``run`` (with
  the initial config), ``history``, ``summary`` (incremental updates), ``config`` (later
  updates), ``artifact``, ``files``, ``telemetry``, ``stats``, ``exit``.
* History, summary and config items carry ``key`` or ``nested_key`` (a path into nested dicts,
  e.g. ``["h", "_type"]`` for a histogram) and a value, as JSON in ``value_json``.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RecordFileError", "OfflineRun", "iter_payloads", "read_records", "find_run_file", "read_run",
           "wait_for_exit_record"]

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK_SIZE = 32 * 1024
CHUNK_HEADER_SIZE = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class RecordFileError(ValueError):
    """A ``.wandb`` file that is not a W&B record file, or is truncated or corrupt."""


def iter_payloads(path: str | Path) -> Iterator[bytes]:
    """The raw payload of every record in the file, in order, CRCs checked."""
    path = Path(path)
    data = path.read_bytes()
    if data[:4] != HEADER[:4] or len(data) < len(HEADER):
        raise RecordFileError(f"{path}: not a W&B record file (header {data[:7]!r}, expected {HEADER!r})")
    if data[:7] != HEADER:
        magic, version = struct.unpack_from("<HB", data, 4)
        raise RecordFileError(f"{path}: unsupported W&B file (magic {magic:#06x}, version {version})")
    pos, parts = len(HEADER), None  # parts: the chunks of a record begun by FIRST
    while pos < len(data):
        block_end = (pos // BLOCK_SIZE + 1) * BLOCK_SIZE
        if block_end - pos < CHUNK_HEADER_SIZE:  # zero trailer of a block
            pos = block_end
            continue
        if pos + CHUNK_HEADER_SIZE > len(data):
            raise RecordFileError(f"{path}: truncated chunk header at offset {pos}")
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if crc == length == kind == 0:  # unused rest of a block
            pos = block_end
            continue
        start, end = pos + CHUNK_HEADER_SIZE, pos + CHUNK_HEADER_SIZE + length
        if end > block_end or kind not in (FULL, FIRST, MIDDLE, LAST):
            raise RecordFileError(f"{path}: bad chunk header at offset {pos} (type {kind}, size {length})")
        if end > len(data):
            raise RecordFileError(f"{path}: truncated chunk at offset {pos} ({end - len(data)} bytes short)")
        if zlib.crc32(data[start - 1 : end]) != crc:
            raise RecordFileError(f"{path}: checksum mismatch in the chunk at offset {pos} (corrupt file)")
        payload = data[start:end]
        if (kind in (FULL, FIRST)) != (parts is None):
            raise RecordFileError(f"{path}: chunk of type {kind} out of sequence at offset {pos}")
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            parts = [payload]
        else:
            parts.append(payload)
            if kind == LAST:
                yield b"".join(parts)
                parts = None
        pos = end
    if parts is not None:
        raise RecordFileError(f"{path}: the last record is truncated (no LAST chunk)")


def read_records(path: str | Path) -> Iterator[Any]:
    """Every record of a ``.wandb`` file as a ``wandb_internal_pb2.Record`` message."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    for i, payload in enumerate(iter_payloads(path)):
        record = pb.Record()
        try:
            record.ParseFromString(payload)
        except DecodeError as exc:
            raise RecordFileError(f"{path}: record {i} is not a valid Record message: {exc}") from exc
        yield record


def find_run_file(run_dir: str | Path) -> Path:
    """The ``run-*.wandb`` file of a run folder; also accepts the file itself or a ``wandb/`` folder
    (its ``latest-run``, else its only run)."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        return run_dir
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no W&B run folder or file at {run_dir}")
    files = sorted(run_dir.glob("run-*.wandb"))
    if len(files) == 1:
        return files[0]
    if files:
        raise RecordFileError(f"{run_dir} holds several run files: {', '.join(f.name for f in files)}")
    if (run_dir / "latest-run").is_dir():
        return find_run_file((run_dir / "latest-run").resolve())
    runs = sorted(p for p in run_dir.glob("*run-*") if p.is_dir())
    if len(runs) == 1:
        return find_run_file(runs[0])
    found = ", ".join(p.name for p in runs) or "nothing"
    raise FileNotFoundError(f"no run-*.wandb file in {run_dir} (found {found})")


@dataclass
class OfflineRun:
    """What a run file says was logged. Values are JSON-decoded; nested keys become nested dicts."""

    path: Path
    """The ``run-*.wandb`` file."""
    run_id: str = ""
    project: str = ""
    name: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    """One dict per logged step, in order, with ``_step`` (and ``_runtime``, ``_timestamp``)."""
    summary: dict = field(default_factory=dict)
    """The final summary, all updates applied."""
    config: dict = field(default_factory=dict)
    """The run config (initial plus updates); ``_wandb`` holds W&B's own entries (chart specs)."""
    artifacts: list[dict] = field(default_factory=list)
    """``name``, ``type``, ``metadata``, ``digest``, ``aliases``, ``files`` of each logged artifact."""
    files: list[str] = field(default_factory=list)
    """Paths (relative to ``run_dir / "files"``) of the files the run saved, e.g. media."""
    exit_code: int | None = None
    """None when the run has no exit record (it did not finish)."""

    @property
    def run_dir(self) -> Path:
        return self.path.parent

    def keys(self) -> list[str]:
        """Every top-level key that appears in some history row, sorted."""
        return sorted({key for row in self.history for key in row})

    def series(self, key: str) -> list[tuple[int, Any]]:
        """``(step, value)`` for every history row holding ``key``."""
        return [(row.get("_step"), row[key]) for row in self.history if key in row]

    def table(self, key: str) -> dict:
        """The JSON (``columns``, ``data``) of a logged table, e.g. ``table("curve_table")`` for
        ``log_line("curve", ...)``; the last one logged under ``key``."""
        rows = [value for _, value in self.series(key) if isinstance(value, dict) and "path" in value]
        if not rows:
            raise KeyError(f"no table logged under {key!r}; history keys: {', '.join(self.keys())}")
        return json.loads((self.run_dir / "files" / rows[-1]["path"]).read_text())


def _item_path(item: Any) -> list[str]:
    return [item.key] if item.key else list(item.nested_key)


def _item_value(item: Any) -> Any:
    kind = item.WhichOneof("value") if "value" in type(item).DESCRIPTOR.oneofs_by_name else None
    if kind == "none":
        return None
    if kind == "json":
        return json.loads(item.json)
    if kind is not None:
        return getattr(item, kind)
    return json.loads(item.value_json)


def _set(tree: dict, path: list[str], value: Any) -> None:
    for name in path[:-1]:
        if not isinstance(tree.get(name), dict):
            tree[name] = {}
        tree = tree[name]
    tree[path[-1]] = value


def _remove(tree: dict, path: list[str]) -> None:
    for name in path[:-1]:
        tree = tree.get(name)
        if not isinstance(tree, dict):
            return
    tree.pop(path[-1], None)


def _apply(tree: dict, update: Any) -> None:
    """Apply a ConfigRecord or SummaryRecord (``update`` then ``remove`` items) to ``tree``."""
    for item in update.update:
        _set(tree, _item_path(item), _item_value(item))
    for item in update.remove:
        _remove(tree, _item_path(item))


def wait_for_exit_record(run_dir: str | Path, timeout: float = 30.0) -> None:
    """Block until wandb-core has flushed the run file through its exit record.

    ``run.finish()`` returns before the service closes the file (it buffers up to a 32 KiB block), so
    a file read straight after it can end mid-record.
    """
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    deadline, delay = time.monotonic() + timeout, 0.005
    while True:
        try:
            for payload in reversed(list(iter_payloads(find_run_file(run_dir)))):
                record = pb.Record()
                record.ParseFromString(payload)
                if record.WhichOneof("record_type") == "exit":
                    return
        except (OSError, RecordFileError, DecodeError):
            pass
        if time.monotonic() > deadline:
            return  # read what is there; the assertions on it will say what is missing
        time.sleep(delay)
        delay = min(2 * delay, 0.25)


def read_run(run: str | Path, wait: bool = True) -> OfflineRun:
    """Replay a run file (or run folder, see :func:`find_run_file`) into an :class:`OfflineRun`; first
    waits for the run's exit record (``wait``) when given a folder or file of a finished run."""
    if wait:
        wait_for_exit_record(run)
    out = OfflineRun(path=find_run_file(run))
    for record in read_records(out.path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            out.run_id, out.project, out.name, out.job_type = r.run_id, r.project, r.display_name, r.job_type
            out.tags = list(r.tags)
            _apply(out.config, r.config)
        elif kind == "history":
            row: dict = {}
            for item in record.history.item:
                _set(row, _item_path(item), _item_value(item))
            if "_step" not in row and record.history.HasField("step"):
                row["_step"] = record.history.step.num
            out.history.append(row)
        elif kind == "summary":
            _apply(out.summary, record.summary)
        elif kind == "config":
            _apply(out.config, record.config)
        elif kind == "artifact":
            a = record.artifact
            out.artifacts.append({
                "name": a.name,
                "type": a.type,
                "metadata": json.loads(a.metadata) if a.metadata else {},
                "digest": a.digest,
                "aliases": list(a.aliases),
                "files": [entry.path for entry in a.manifest.contents],
            })
        elif kind == "files":
            out.files += [f.path for f in record.files.files]
        elif kind == "exit":
            out.exit_code = record.exit.exit_code
    return out
