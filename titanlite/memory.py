"""Peak memory per device, and what the number means - each backend exposes a different counter.

- CUDA: `torch.cuda.max_memory_allocated` - the high-water mark of bytes held by live tensors
  in PyTorch's caching allocator since the last reset. Excludes the allocator's cached-but-free
  blocks, the CUDA context (hundreds of MiB) and other processes, so it is below `nvidia-smi`.
- MPS: `torch.mps.driver_allocated_memory` - what Metal has handed the process right now,
  *including* the allocator's cache. MPS has no peak counter; because freed blocks stay cached
  until `empty_cache()`, reading it after a step approximates that step's high-water mark,
  and `reset_peak_memory` empties the cache so the next reading starts from live tensors.
- CPU: the process's peak resident set size (RSS): every byte of the process, Python and the
  torch libraries included (hundreds of MiB before any tensor), so compare *differences*. On Linux the
  peak can be reset (write "5" to /proc/self/clear_refs) and is read from VmHWM; elsewhere it is
  `getrusage().ru_maxrss`, a lifetime high-water mark that never goes down.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

MEMORY_METRIC_DOC = {
    "cuda": "torch.cuda.max_memory_allocated: peak bytes of live tensors in PyTorch's caching "
            "allocator since the last reset. Excludes cached-but-free blocks, the CUDA context and "
            "other processes, so nvidia-smi shows more.",
    "mps": "torch.mps.driver_allocated_memory: bytes Metal has given this process now, including "
           "the allocator's cache. MPS has no peak counter; since freed blocks stay cached, the "
           "reading after a step approximates its peak (reset_peak_memory empties the cache).",
    "cpu": "peak resident set size (RSS) of the whole process - Python and torch libraries included "
           "(hundreds of MiB before any tensor), so compare differences. Linux: VmHWM, resettable via "
           "/proc/self/clear_refs; elsewhere getrusage ru_maxrss, a lifetime peak.",
}


def reset_peak_memory(device) -> None:
    """Start a new peak-memory window (see MEMORY_METRIC_DOC for what each device can do)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "mps":
        torch.mps.empty_cache()
    else:
        try:  # "5" resets the kernel's RSS high-water mark for this process (Linux >= 4.0)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass  # macOS / locked-down container: the peak stays a lifetime peak


def peak_memory_bytes(device) -> int:
    """Peak memory in bytes for this device type; MEMORY_METRIC_DOC says exactly what it counts."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # POSIX only, hence imported here

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # macOS: bytes; Linux: KiB
