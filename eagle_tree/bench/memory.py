"""Peak memory of one call: the peak above the level at its start.

:class:`PeakMemory` reads CUDA's ``max_memory_allocated`` on a GPU; on Linux CPU the peak resident
set size (``VmHWM``, reset through ``/proc/self/clear_refs`` before each call); elsewhere the growth
of ``ru_maxrss`` (which cannot be reset, so later calls often read 0).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


class PeakMemory:
    """``with PeakMemory(device) as mem: ...`` then ``mem.peak_bytes``: the peak above the start."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.method = _memory_method(self.device)
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.method == "cuda_max_memory_allocated":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif self.method == "linux_vmhwm":
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self._start = _proc_status_bytes("VmRSS")
        else:
            self._start = _ru_maxrss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        if self.method == "cuda_max_memory_allocated":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self.method == "linux_vmhwm":
            peak = _proc_status_bytes("VmHWM")
        else:
            peak = _ru_maxrss_bytes()
        self.peak_bytes = max(0, peak - self._start)


def _memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "cuda_max_memory_allocated"
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _proc_status_bytes("VmHWM")
        return "linux_vmhwm"
    except (OSError, KeyError):
        return "ru_maxrss"


def _proc_status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise KeyError(key)


def _ru_maxrss_bytes() -> int:
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
