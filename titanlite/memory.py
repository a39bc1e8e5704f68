"""Peak memory of a step, per device: each backend exposes a different counter, so the numbers
are not comparable across devices (MEMORY_METRIC_DOC says what each one counts). On CUDA
`allocator_readings` adds what the allocated peak hides: memory *reserved* from the driver (cache
and fragmentation included) and the allocator's retries after a failed allocation."""

import contextlib
import os
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


_mps_peak = 0  # the largest reading of Metal's allocation so far: that can fall, a peak must not


def _sample_mps_peak() -> int:
    global _mps_peak
    _mps_peak = max(_mps_peak, int(torch.mps.driver_allocated_memory()))
    return _mps_peak


def reset_peak_memory(device) -> None:
    """Start a new peak-memory window where the device has one (CUDA; CPU on Linux)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "mps":
        _sample_mps_peak()  # no window to open
    else:  # macOS / a locked-down container cannot: the peak stays a lifetime peak
        # "5" resets this process's RSS high-water mark (Linux >= 4.0)
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")


def peak_memory_bytes(device) -> int:
    """Peak memory in bytes for this device type (MEMORY_METRIC_DOC: what it counts)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        return _sample_mps_peak()
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource  # POSIX only (not on Windows), hence imported here

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # macOS: bytes; Linux: KiB


def allocator_readings(device) -> dict:
    """CUDA's reserved_memory_bytes (peak held from the driver: live + cached + fragmented) and alloc_retries
    (failed allocations retried after emptying the cache: slow, synchronising, near full); None elsewhere."""
    if torch.device(device).type != "cuda":
        return {"reserved_memory_bytes": None, "alloc_retries": None}
    return readings_from_stats(torch.cuda.memory_stats(device))


def readings_from_stats(stats: dict) -> dict:
    """The record fields from a `torch.cuda.memory_stats()` dict (empty before any allocation)."""
    return {
        "reserved_memory_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
    }


def memory_limit_bytes(device) -> int | None:
    """The most memory a process could use on `device`: a GPU's total memory, or the host's RAM (a
    container's cgroup limit where that is lower); None where it cannot be read. Not what is free
    now: a run that cannot fit even in all of it is refused, a busy machine is not."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory())
    limits = []
    with contextlib.suppress(OSError, ValueError, AttributeError):
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    with contextlib.suppress(OSError, ValueError):  # cgroup v2: "max" when unlimited
        limits.append(int(Path("/sys/fs/cgroup/memory.max").read_text().strip()))
    return min(limits, default=None)
