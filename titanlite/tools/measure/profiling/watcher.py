"""The steps `[profile] steps = "5-8"` names, under the profiler, written to files a viewer opens:

    <trace_dir>/rank<r>.pt.trace.json      Chrome trace: ui.perfetto.dev or TensorBoard's
                                           profiler plugin (torch-tb-profiler reads *.pt.trace.json)
    <trace_dir>/rank<r>.memory.json        bytes allocated over those steps (any device)
    <trace_dir>/rank<r>.memory_snapshot.pickle   CUDA: every allocation with its stack,
                                           for pytorch.org/memory_viz

One file per rank, named by it, so a torchrun job's traces sit side by side. Steps count from 1,
as the training records do. The profiled steps run slower (the profiler records every operator):
their tokens/s in metrics.jsonl say so honestly rather than being hidden.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.profiler import profile, record_function

from ....config_fields import parse_steps
from ....watchers import Run, StepEnd, Watcher


def memory_record_kind(device_type: str, has_history_api: bool = True) -> str:
    """Which memory record a device gets. CUDA's caching allocator keeps a history of every
    allocation with its Python stack ("snapshot", the richest view there is); elsewhere (CPU,
    MPS) the profiler's own memory events give the allocated bytes over time ("timeline")."""
    return "snapshot" if device_type == "cuda" and has_history_api else "timeline"


def trace_files(trace_dir: str | Path, rank: int) -> dict[str, Path]:
    d = Path(trace_dir)
    return {
        "trace": d / f"rank{rank}.pt.trace.json",
        "memory": d / f"rank{rank}.memory.json",
        "snapshot": d / f"rank{rank}.memory_snapshot.pickle",
    }


class StepProfiler(Watcher):
    """Starts the profiler as the first named step begins, stops it after the last, and writes
    this rank's files. Each step is wrapped in "ProfilerStep#<step>", the label
    torch.profiler's own schedule uses, so TensorBoard's plugin finds the steps.
    A tool handed to the loop: `Trainer.fit(watchers=[StepProfiler])` makes one from the run's
    facts (`titanlite train` does when [profile] steps is set)."""

    profiles = True  # the loop's note "profile.steps is set but nothing profiles" stays quiet

    def __init__(self, run: Run):
        cfg = run.cfg
        self.first, self.last = parse_steps(cfg.profile.steps, cfg.training.steps) or (0, -1)
        self.memory = cfg.profile.memory
        self.device = run.device
        self.kind = memory_record_kind(
            self.device.type, hasattr(torch.cuda.memory, "_record_memory_history")
        )
        self.files = trace_files(cfg.profile.trace_dir or Path(run.run_dir) / "trace", run.rank)
        self.prof = None
        self.step_label = None

    def on_step_start(self, step: int) -> None:
        if not self.first <= step <= self.last:
            return
        if (
            self.prof is None
        ):  # the first profiled step (or the first after a resume inside the range)
            from .steps import _quiet_fd2, activities_for

            if self.memory and self.kind == "snapshot":
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            # record_shapes names each allocation's operator and its inputs in the trace
            self.prof = profile(
                activities=activities_for(self.device.type),
                profile_memory=self.memory,
                record_shapes=self.memory,
            )
            with _quiet_fd2():
                self.prof.__enter__()
        self.step_label = record_function(f"ProfilerStep#{step}")
        self.step_label.__enter__()

    def on_step_end(self, end: StepEnd) -> None:
        if self.step_label is not None:
            self.step_label.__exit__(None, None, None)
            self.step_label = None
        if self.prof is not None and end.step >= self.last:
            self._stop_and_write()

    def _stop_and_write(self) -> None:
        from .reading import memory_timeline
        from .steps import _quiet_fd2

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last kernels belong in the trace
        with _quiet_fd2():
            self.prof.__exit__(None, None, None)
        prof, self.prof = self.prof, None
        self.files["trace"].parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.files["trace"]))
        if not self.memory:
            return
        t_s, allocated = memory_timeline(self.files["trace"], device=self.device.type)
        self.files["memory"].write_text(
            json.dumps(
                {
                    "device": str(self.device),
                    "steps": [self.first, self.last],
                    "t_s": t_s,
                    "bytes_allocated": allocated,
                    "source": "profiler [memory] events of the trace",
                }
            )
        )
        if self.kind == "snapshot":
            torch.cuda.memory._dump_snapshot(str(self.files["snapshot"]))
            torch.cuda.memory._record_memory_history(enabled=None)  # stop recording

    def close(self) -> None:
        """A run that ended inside the range (failure, interrupt): stop, and write what was seen."""
        if self.step_label is not None:
            self.step_label.__exit__(None, None, None)
            self.step_label = None
        if self.prof is not None:
            self._stop_and_write()
