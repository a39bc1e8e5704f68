"""Training steps under `torch.profiler`, and the operators that took the most time.

The profiler's C++ backend (kineto) prints "profiler_start/stop" lines straight to file
descriptor 2, which Jupyter shows as red stderr; they say nothing to a learner, so we point
fd 2 at /dev/null while it starts and stops."""

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
