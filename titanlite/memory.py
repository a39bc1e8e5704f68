"""Peak memory per device, and what the number means - each backend exposes a different counter.

- CUDA: `torch.cuda.max_memory_allocated` - the high-water mark of bytes held by live tensors
  in PyTorch's caching allocator since the last reset. Excludes the allocator's cached-but-free
  blocks, the CUDA context (hundreds of MiB) and other processes, so it is below `nvidia-smi`.
- MPS: the running maximum of `torch.mps.driver_allocated_memory` - what Metal has handed the
  process, *including* the allocator's cache of freed blocks. MPS has no resettable peak
  counter. Emptying the cache to start a window would make every step re-allocate from Metal
  (slow, and not how a run behaves), so we do not: the cache keeps the largest step's blocks,
  and the reading is a high-water mark since the process started, like `ru_maxrss` on macOS.
- CPU: the process's peak resident set size (RSS): every byte of the process, Python and the
  torch libraries included (hundreds of MiB before any tensor), so compare *differences*. On Linux the
  peak can be reset (write "5" to /proc/self/clear_refs) and is read from VmHWM; elsewhere it is
  `getrusage().ru_maxrss`, a lifetime high-water mark that never goes down.

On CUDA `allocator_readings` adds what the allocated peak hides: memory *reserved* from the
driver (cache and fragmentation included) and the allocator's retries after a failed allocation.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

MEMORY_METRIC_DOC = {
    "cuda": "torch.cuda.max_memory_allocated: peak bytes of live tensors in PyTorch's caching "
            "allocator since the last reset. Excludes cached-but-free blocks, the CUDA context and "
            "other processes, so nvidia-smi shows more.",
    "mps": "running max of torch.mps.driver_allocated_memory: bytes Metal has given this process, "
           "including the allocator's cache of freed blocks. MPS has no resettable peak, and the "
           "cache is not emptied (that would slow every step), so it is a peak since process start.",
    "cpu": "peak resident set size (RSS) of the whole process - Python and torch libraries included "
           "(hundreds of MiB before any tensor), so compare differences. Linux: VmHWM, resettable via "
           "/proc/self/clear_refs; elsewhere getrusage ru_maxrss, a lifetime peak.",
}


class RunningPeak:
    """The largest value sampled so far. Metal's allocation can *fall* (the allocator returns
    blocks under memory pressure), and a peak must not: keep the maximum of every reading."""

    def __init__(self):
        self.value = 0

    def sample(self, reading: int) -> int:
        self.value = max(self.value, int(reading))
        return self.value


_MPS_PEAK = RunningPeak()


def reset_peak_memory(device) -> None:
    """Start a new peak-memory window (see MEMORY_METRIC_DOC for what each device can do)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "mps":
        _MPS_PEAK.sample(torch.mps.driver_allocated_memory())  # no window to open: see above
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
        return _MPS_PEAK.sample(torch.mps.driver_allocated_memory())
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # POSIX only, hence imported here

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # macOS: bytes; Linux: KiB


def allocator_readings(device) -> dict:
    """CUDA allocator facts beside the allocated peak, as train-record fields (None elsewhere):
    reserved_memory_bytes - peak bytes the caching allocator held from the driver since the
      last reset (live tensors + cached free blocks + fragmentation: what nvidia-smi sees,
      less the CUDA context); allocated far below reserved means fragmentation.
    alloc_retries - times since process start an allocation failed, so the allocator freed its
      whole cache and tried again (a synchronising, slow path): above zero, the run is at the
      edge of memory; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True often helps."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"reserved_memory_bytes": None, "alloc_retries": None}
    return readings_from_stats(torch.cuda.memory_stats(device))


def readings_from_stats(stats: dict) -> dict:
    """The record fields from a `torch.cuda.memory_stats()` dict (an empty one before any
    allocation counts as zero)."""
    return {"reserved_memory_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0))}
