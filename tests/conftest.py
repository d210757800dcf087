"""Suite-wide settings: the tiny models here are bound by per-op overhead, so one torch thread is
faster than two on the 2-core CI machines (and keeps timings steadier)."""

import os

import torch

from tests.tiny_gguf import model, tiny, tokenizer  # noqa: F401 (fixtures: the tiny GGUF file, its model and tokenizer)

os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(1)
