"""A run killed with SIGKILL after a checkpoint and resumed ends with the weights of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle_tree.data.toy import default_cache_dir
from eagle_tree.training.checkpoint import latest_checkpoint
from eagle_tree.training.config import TrainConfig
from eagle_tree.training.loop import train
from eagle_tree.utils.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
TOY_CACHE = str(default_cache_dir())
STEPS = 24
# data.limit=40 with batch 8: 5 batches an epoch, so the run crosses epochs and the kill lands mid-epoch
COMMON = [f"target.toy_cache_dir={TOY_CACHE}", f"schedule.max_steps={STEPS}", "schedule.warmup_steps=4",
          "checkpoint.every=4", "checkpoint.keep_last=2", "data.limit=40", "eval.prompts=null",
          "wandb.mode=disabled", "progress=false", "threads=1"]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    reference = train(load_config(TrainConfig, SMOKE, [f"output_dir={tmp_path / 'straight'}", *COMMON]))
    assert reference.steps == STEPS

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "eagle_tree.cli", "train", "--config", str(SMOKE), f"output_dir={out}", *COMMON]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    try:
        while latest_checkpoint(out) is None:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "final").exists()  # it really was interrupted
    step_at_kill = int(latest_checkpoint(out).name.removeprefix("step-"))
    assert step_at_kill < STEPS

    resumed = train(load_config(TrainConfig, SMOKE, [f"output_dir={out}", "resume=latest", *COMMON]))
    assert resumed.steps == STEPS and resumed.tokens == reference.tokens
    want, got = weights(reference.final_dir), weights(resumed.final_dir)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)

    # negative control: the last 4 steps redone from the step-20 weights without the optimiser state,
    # schedule and data position (a weights-only warm start) end elsewhere
    warm = train(load_config(TrainConfig, SMOKE, [f"output_dir={tmp_path / 'warm'}", *COMMON,
                                                  f"model.init_from={out / 'checkpoints' / 'step-20'}",
                                                  "schedule.max_steps=4"]))
    differs = any(not torch.allclose(weights(warm.final_dir)[k].float(), want[k].float(), atol=1e-6) for k in want)
    assert differs


def test_latest_checkpoint_ignores_partial_folders(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for name in ("step-4", "step-12", ".step-16.partial"):
        (ckpts / name).mkdir(parents=True)
        (ckpts / name / "training_state.pt").write_bytes(b"x")
    (ckpts / "step-20").mkdir()  # no training_state.pt: an incomplete copy
    assert latest_checkpoint(tmp_path) == ckpts / "step-12"
    assert latest_checkpoint(tmp_path / "nothing") is None
