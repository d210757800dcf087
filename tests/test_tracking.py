"""RunLogger logs offline without credentials, and the test oracle tests/wandb_records.py reads exactly that back."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib

import pytest

from eagle_tree.utils.tracking import RunLogger, WandbConfig, resolve_mode
from tests.wandb_records import (
    BLOCK_SIZE,
    HEADER,
    RecordFileError,
    find_run_file,
    iter_payloads,
    read_records,
    read_run,
    wait_for_exit_record,
)

STEPS = [{"train/loss": 2.5 - s / 3, "train/acc_0": s / 7, "train/tokens": 1000 * s} for s in range(4)]
LONG_TEXT = "eagle " * 12_000  # one record over two 32 KiB blocks: FIRST, MIDDLE, LAST chunks


def offline_env(mp: pytest.MonkeyPatch, home) -> None:
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC", "WANDB_DATA_DIR"):
        mp.delenv(name, raising=False)
    mp.setenv("HOME", str(home))
    mp.setenv("WANDB_DIR", str(home))


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """One offline run that logs scalars, a histogram, a line plot, an image, a summary and an artifact."""
    from PIL import Image

    home = tmp_path_factory.mktemp("home")
    image = home / "figure.png"
    Image.new("RGB", (4, 3), (200, 30, 30)).save(image)
    checkpoint = home / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "weights.bin").write_bytes(b"\x00" * 16)
    with pytest.MonkeyPatch.context() as mp:
        offline_env(mp, home)
        cfg = WandbConfig(project="eagle-tree-test", name="unit", tags=["ci"])
        with RunLogger(cfg, run_config={"train": {"lr": 3e-4}, "seed": 0}, job_type="train") as logger:
            assert logger.mode == "offline" and logger.enabled
            for step, metrics in enumerate(STEPS):
                logger.log(metrics, step=step)
            logger.log_histogram("train/accepted", [1, 2, 2, 3, 3, 3], step=4)
            logger.log_line("eval/survival", [1, 2, 3], [1.0, 0.75, 0.5], "Survival", "depth", "p", step=4)
            logger.log_image("eval/figure", image, step=4)
            logger.log({"notes": LONG_TEXT}, step=5)
            logger.summary({"eval/acceptance_length": 3.25})
            logger.log_artifact(checkpoint, "draft-head", "model", {"acceptance_length": 3.25})
        logger.finish()  # a second finish is a no-op
    wait_for_exit_record(logger.run_dir)  # finish() does not wait for wandb-core to flush the file
    return logger.run_dir, home


def test_offline_run_reads_back_exactly(logged):
    run_dir, home = logged
    assert run_dir.parent == home / "wandb" and run_dir.name.startswith("offline-run-")
    run = read_run(run_dir)
    assert (run.project, run.name, run.job_type, run.tags) == ("eagle-tree-test", "unit", "train", ["ci"])
    assert run.exit_code == 0
    for key in ("train/loss", "train/acc_0", "train/tokens"):
        assert run.series(key) == [(step, metrics[key]) for step, metrics in enumerate(STEPS)]
    assert {"train/loss", "train/accepted", "eval/survival_table", "eval/figure", "notes"} <= set(run.keys())
    assert run.series("notes") == [(5, LONG_TEXT)]
    assert run.config["train"] == {"lr": 3e-4} and run.config["seed"] == 0
    assert run.summary["eval/acceptance_length"] == 3.25
    assert run.summary["train/loss"] == STEPS[-1]["train/loss"]


def test_figures_are_in_the_run(logged):
    run = read_run(logged[0])
    (step, hist), = run.series("train/accepted")
    assert step == 4 and hist["_type"] == "histogram" and sum(hist["values"]) == 6
    table = run.table("eval/survival_table")
    assert table == {"columns": ["depth", "p"], "data": [[1, 1.0], [2, 0.75], [3, 0.5]]}
    chart = run.config["_wandb"]["visualize"]["eval/survival"]["panel_config"]
    assert chart["fieldSettings"]["x"] == "depth" and chart["stringSettings"]["title"] == "Survival"
    (_, image), = run.series("eval/figure")
    assert image["_type"] == "image-file" and (image["width"], image["height"]) == (4, 3)
    assert (run.run_dir / "files" / image["path"]).is_file() and image["path"] in run.files


def test_artifact_recorded(logged):
    run = read_run(logged[0])
    heads = [a for a in run.artifacts if a["name"] == "draft-head"]
    assert heads == [{"name": "draft-head", "type": "model", "metadata": {"acceptance_length": 3.25},
                      "digest": heads[0]["digest"], "aliases": ["latest"], "files": ["weights.bin"]}]


def test_run_file_framing(logged):
    run_dir, home = logged
    path = find_run_file(run_dir)
    assert path == find_run_file(home / "wandb") == find_run_file(path)  # latest-run and the file itself
    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00" == HEADER and len(data) > 2 * BLOCK_SIZE
    crc, length, kind = struct.unpack_from("<IHB", data, 7)
    assert kind == 1 and crc == zlib.crc32(data[13 : 14 + length])  # plain CRC-32 of type + payload
    kinds = [r.WhichOneof("record_type") for r in read_records(path)]
    assert kinds[0] == "header" and kinds[1] == "run" and kinds[-1] == "exit"
    assert {"history", "summary", "config", "artifact", "files"} <= set(kinds)


def frame(payloads: list[bytes]) -> bytes:
    """A record file framed like wandb-core's writer (for cases a real run rarely hits)."""
    out = bytearray(HEADER)
    for payload in payloads:
        first = True
        while True:
            left = BLOCK_SIZE - len(out) % BLOCK_SIZE
            if left < 7:  # block trailer
                out += bytes(left)
                left = BLOCK_SIZE
            chunk, payload = payload[: left - 7], payload[left - 7 :]
            kind = (1 if not payload else 2) if first else (4 if not payload else 3)
            out += struct.pack("<IHB", zlib.crc32(bytes([kind]) + chunk), len(chunk), kind) + chunk
            first = False
            if not payload:
                break
    return bytes(out)


def test_block_trailer_and_spanning_records(tmp_path):
    payloads = [b"a" * (BLOCK_SIZE - 7 - 7 - 3), b"b" * 10, b"c" * 70_000, b"", b"d"]  # 3-byte trailer
    path = tmp_path / "run-x.wandb"
    path.write_bytes(frame(payloads))
    assert list(iter_payloads(path)) == payloads
    path.write_bytes(frame(payloads[:2]) + bytes(100))  # zeroed tail (preallocated file)
    assert list(iter_payloads(path)) == payloads[:2]


def test_corrupt_and_missing_files(logged, tmp_path):
    data = bytearray(find_run_file(logged[0]).read_bytes())
    path = tmp_path / "run-bad.wandb"

    flipped = data.copy()
    flipped[30] ^= 0xFF  # inside the first record's payload
    path.write_bytes(bytes(flipped))
    with pytest.raises(RecordFileError, match="checksum mismatch in the chunk at offset 7"):
        read_run(path, wait=False)  # a damaged file never gets its exit record: no 30 s wait
    path.write_bytes(bytes(data[: len(data) - 5]))
    with pytest.raises(RecordFileError, match="truncated"):
        read_run(path, wait=False)
    path.write_bytes(b"PK\x03\x04" + bytes(data[4:]))
    with pytest.raises(RecordFileError, match="not a W&B record file"):
        read_run(path, wait=False)
    path.write_bytes(b"")
    with pytest.raises(RecordFileError, match="not a W&B record file"):
        read_run(path, wait=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no run-\\*.wandb file"):
        read_run(tmp_path / "empty", wait=False)
    with pytest.raises(FileNotFoundError, match="no W&B run folder or file"):
        read_run(tmp_path / "absent", wait=False)


def test_disabled_mode_writes_nothing(tmp_path, monkeypatch):
    offline_env(monkeypatch, tmp_path)
    with RunLogger(WandbConfig(mode="disabled", dir=str(tmp_path / "wb")), run_config={"a": 1}) as logger:
        assert not logger.enabled and logger.run_dir is None
        logger.log({"train/loss": 1.0}, step=0)
        logger.log_histogram("h", [1, 2])
        logger.log_line("c", [0, 1], [1.0, 0.5])
        logger.log_image("i", tmp_path / "absent.png")
        logger.summary({"s": 1})
        logger.log_artifact(tmp_path / "absent", "a", "model", {})
    assert list(tmp_path.iterdir()) == []


def test_auto_mode(tmp_path, monkeypatch):
    offline_env(monkeypatch, tmp_path)
    assert resolve_mode("auto") == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert resolve_mode("auto") == "online"
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode("auto") == "disabled"
    assert resolve_mode("offline") == "offline"
    with pytest.raises(ValueError, match="unknown wandb mode 'sometimes'"):
        resolve_mode("sometimes")


def test_import_does_not_load_wandb():
    code = (
        "import sys\n"
        "import eagle_tree.utils.config, eagle_tree.utils.tracking as t\n"
        "with t.RunLogger(t.WandbConfig(mode='disabled')) as logger:\n"
        "    logger.log({'x': 1.0})\n"
        "print('wandb' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

