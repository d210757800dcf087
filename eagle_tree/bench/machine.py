"""The conditions of a bench run: machine, library versions, threads, precision, model sizes."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from eagle_tree.bench.memory import PeakMemory
from eagle_tree.bench.runner import BenchModels


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def n_params(module) -> int | None:
    return None if module is None else sum(p.numel() for p in module.parameters())


def conditions(models: BenchModels, dtype: str) -> dict:
    """The machine, library versions, threads, precision and model sizes of a bench run."""
    import transformers

    target = models.target
    device = target.device
    info = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "device": str(device),
        "dtype": dtype,
        "attention": getattr(target.config, "_attn_implementation", None),
        "target": {"parameters": n_params(target.model), "layers": target.num_layers,
                   "hidden_size": target.hidden_size, "vocab_size": target.vocab_size},
        "head": None if models.head is None else {"parameters": n_params(models.head),
                                                  "feature_layers": list(models.head.config.feature_layers)},
        "assistant": None if models.assistant is None else {
            "parameters": n_params(models.assistant), "layers": models.assistant.config.num_hidden_layers},
        "memory_method": PeakMemory(device).method,
        "target_kernels": None if getattr(target, "prepack_choice", None) is None else target.prepack_choice.as_dict(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
