"""Peak memory of one rank since a mark: CUDA allocator statistics on a GPU, the process's peak resident set
(Linux VmHWM, reset at the mark) on the CPU. What `asyncpipe plan` is checked against."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def mark(device: Any) -> int:
    """Start measuring: bytes in use now (the baseline), with the peak reset to it."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return _status_kib("VmRSS") * 1024
    except OSError:  # not Linux: no measurement
        return -1


def peak_since(baseline: int, device: Any) -> int:
    """Peak bytes above ``baseline`` since `mark` (-1 when this platform cannot tell)."""
    import torch

    if baseline < 0:
        return -1
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)) - baseline
    return _status_kib("VmHWM") * 1024 - baseline
