"""Where does the time go, and where does the memory go? Training steps under `torch.profiler`.

profile_steps(trainer, 5) + top_ops(prof)   a table of the operators with the most time:
                                             steps.py
[profile] steps = "5-8"                      the trainer writes a trace (and memory record)
                                             of those steps: watcher.py
trace_phases(dir), memory_timeline(dir)      read them back: reading.py
"""

from .reading import (
    memory_timeline,
    phase_at,
    phase_seconds,
    plot_memory,
    plot_phases,
    trace_phases,
)
from .steps import activities_for, profile_steps, top_ops
from .watcher import StepProfiler, memory_record_kind, parse_steps

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
