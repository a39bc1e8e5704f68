"""Where does the time go, and where does the memory go? Training steps under `torch.profiler`.

    profile_steps(trainer, 5) + top_ops(prof)   a table of the operators with the most time
    [profile] steps = "5-8"                      the trainer writes a trace (and memory record)
                                                 of those steps: watcher.py
    trace_phases(dir), memory_timeline(dir)      read them back: reading.py

The profiler's C++ backend (kineto) prints "profiler_start/stop" lines straight to file
descriptor 2, which Jupyter shows as red stderr; they say nothing to a learner, so we point
fd 2 at /dev/null while it starts and stops.
"""

from __future__ import annotations

import contextlib
import os
import sys

from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def _quiet_fd2():
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def activities_for(device_type: str) -> list[ProfilerActivity]:
    """What the profiler records: host operators always, the device's kernels where kineto
    can see them (CUDA; an MPS or CPU run has only the host)."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])


def profile_steps(trainer, steps: int = 5):
    """Run `steps` training steps under the profiler; returns the `torch.profiler.profile`."""
    prof = profile(activities=activities_for(trainer.device.type))
    with _quiet_fd2():
        prof.__enter__()
    try:
        for _ in range(steps):
            trainer.train_step(trainer.next_micro_batches())
    finally:
        with _quiet_fd2():
            prof.__exit__(None, None, None)
    return prof


def top_ops(prof, n: int = 8, device_type: str = "cpu") -> list[tuple[str, float]]:
    """The n operators with the most self time, as (name, share of the total self time)."""
    attr = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    total = sum(getattr(e, attr) for e in events) or 1
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return [(e.key, getattr(e, attr) / total) for e in events[:n]]


from .reading import (  # noqa: E402
    memory_timeline,
    phase_at,
    phase_seconds,
    plot_memory,
    plot_phases,
    trace_phases,
)
from .watcher import StepProfiler, memory_record_kind, parse_steps  # noqa: E402

__all__ = [
    "profile_steps",
    "top_ops",
    "activities_for",
    "StepProfiler",
    "memory_record_kind",
    "parse_steps",
    "trace_phases",
    "phase_seconds",
    "phase_at",
    "memory_timeline",
    "plot_phases",
    "plot_memory",
]
