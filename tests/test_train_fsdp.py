"""FSDP on two CPU processes (torchrun, gloo): the smoke config trains with the head sharded by torch's
``fully_shard`` (accelerate 1.15 ignores its FSDP plugin on CPU and would use DDP; training/sharding.py),
saves sharded checkpoints, is killed with SIGKILL, resumes, and ends with the weights of an uninterrupted
run of the same training (one process accumulating the same two micro-batches per step, which the DDP
test shows equal to two processes).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle_tree.data.toy import build_toy, default_cache_dir
from eagle_tree.training.checkpoint import STATE_NAME, latest_checkpoint
from eagle_tree.training.config import TrainConfig
from eagle_tree.training.loop import train
from eagle_tree.utils.config import load_config
from tests.test_train_distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
TOY_CACHE = str(default_cache_dir())
STEPS = 24
# batch 4 per process and 48 examples: 12 micro-batches an epoch, 6 steps, so the run crosses epochs
COMMON = [f"target.toy_cache_dir={TOY_CACHE}", f"schedule.max_steps={STEPS}", "schedule.warmup_steps=2",
          "optim.batch_size=4", "data.limit=48", "eval.at_start=false", "eval.every=0", "eval.prompts=null",
          "checkpoint.every=4", "checkpoint.keep_last=null", "progress=false", "threads=1", "wandb.mode=disabled"]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the launcher starts the ranks in process groups of their own)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def fsdp_command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), "-m", "eagle_tree.cli", "train", "--config", str(SMOKE),
            f"output_dir={out}", "cpu=true", *COMMON, *extra]


@pytest.mark.slow
def test_fsdp_on_cpu_killed_and_resumed_ends_like_an_uninterrupted_run(tmp_path):
    build_toy(load_config(TrainConfig, SMOKE).target.toy, TOY_CACHE)  # built once here, not raced by the ranks
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "RANK", "WORLD_SIZE", "ACCELERATE_"))}
    env.update(HOME=str(tmp_path), ACCELERATE_USE_FSDP="true", OMP_NUM_THREADS="1")
    out = tmp_path / "fsdp"

    proc = subprocess.Popen(fsdp_command(out), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 400
    try:
        while latest_checkpoint(out) is None:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        for pid in [*descendants(proc.pid), proc.pid]:  # the ranks, then the launcher
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        seen = sorted(p.name for p in (out / "checkpoints").iterdir())
    finally:
        proc.wait(timeout=60)
        log = proc.stdout.read().decode()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert "sharded by torch's fully_shard" in log
    assert not (out / "final").exists(), (seen, log[-3000:])
    first = latest_checkpoint(out)
    assert int(first.name.removeprefix("step-")) < STEPS
    # a sharded checkpoint: one optimiser shard per rank, none in the shared training state
    assert (first / "optimizer-rank0.pt").is_file() and (first / "optimizer-rank1.pt").is_file()
    assert torch.load(first / STATE_NAME, weights_only=False)["optimizer"] is None

    resumed = subprocess.run(fsdp_command(out, "resume=latest"), cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"resumed from {first}" in resumed.stdout
    got = load_file(str(out / "final" / "model.safetensors"))

    single = train(load_config(TrainConfig, SMOKE, [f"output_dir={tmp_path / 'single'}", "optim.grad_accum=2",
                                                    *COMMON]))
    want = load_file(str(single.final_dir / "model.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
