"""Two CPU processes (torchrun + accelerate, gloo DDP): both ranks train, the result is saved once, and it
equals one process accumulating the same two micro-batches per step.

`accelerate launch --cpu --num_processes 2` starts a single process in accelerate 1.15 (multi-CPU goes
through mpirun and needs a hostfile), so CPU runs are launched with torchrun, which accelerate detects.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle_tree.data.toy import build_toy, default_cache_dir
from eagle_tree.training.config import TrainConfig
from eagle_tree.training.loop import train
from eagle_tree.utils.config import load_config
from tests.wandb_records import read_run

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
TOY_CACHE = str(default_cache_dir())
COMMON = [f"target.toy_cache_dir={TOY_CACHE}", "schedule.max_steps=6", "schedule.warmup_steps=2", "optim.batch_size=4",
          "data.limit=48", "eval.at_start=false", "eval.every=0", "eval.num_prompts=2", "eval.max_new_tokens=8",
          "checkpoint.every=3", "checkpoint.keep_last=null", "progress=false", "threads=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_ddp_on_cpu(tmp_path):
    build_toy(load_config(TrainConfig, SMOKE).target.toy, TOY_CACHE)  # built once here, not raced by the ranks
    out = tmp_path / "ddp"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "RANK", "WORLD_SIZE"))}
    env.update(HOME=str(tmp_path), WANDB_DIR=str(tmp_path), WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "eagle_tree.cli", "train", "--config", str(SMOKE),
           f"output_dir={out}", "cpu=true", "features.source=cache", "features.examples_per_shard=8", *COMMON]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]

    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert len(summary["tokens_per_rank"]) == 2 and all(n > 0 for n in summary["tokens_per_rank"])
    assert sum(summary["tokens_per_rank"]) == summary["tokens"]
    # saved once: one final head, one checkpoint per save step, nothing half-written, one W&B run
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3", "step-6"]
    assert not [p for p in out.rglob("*") if ".partial" in p.name or p.name.endswith(".tmp")]
    assert (out / "final" / "model.safetensors").is_file()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run = read_run(runs[0])
    assert run.summary["run/world_size"] == 2
    assert [s for s, _ in run.series("train/loss")] == list(range(1, 7))
    assert [s for s, _ in run.series("eval/acceptance_length_chain")] == [6]
    # both ranks built feature-cache shards: 48 examples, 8 a shard, shard s by rank s % 2
    assert len(list((out / "feature_cache").glob("shard-*.safetensors"))) == 6
    assert proc.stdout.count("head in") == 1  # the main process alone reports the result

    # the DDP update (mean of the two ranks' gradients) equals one process accumulating both micro-batches
    single = train(load_config(TrainConfig, SMOKE, [f"output_dir={tmp_path / 'single'}", "optim.grad_accum=2",
                                                    "wandb.mode=disabled", *COMMON]))
    ddp = load_file(str(out / "final" / "model.safetensors"))
    one = load_file(str(single.final_dir / "model.safetensors"))
    for name in ddp:
        torch.testing.assert_close(ddp[name], one[name], rtol=0, atol=1e-5, msg=name)
    # negative control: one process with one micro-batch per step (half the data) ends elsewhere
    half = train(load_config(TrainConfig, SMOKE, [f"output_dir={tmp_path / 'half'}", "wandb.mode=disabled",
                                                  "eval.prompts=null", *COMMON]))
    other = load_file(str(half.final_dir / "model.safetensors"))
    assert any(not torch.allclose(ddp[k].float(), other[k].float(), atol=1e-5) for k in ddp)
