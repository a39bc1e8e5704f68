"""Goodput, measured: the share of wall time that became training the final model kept.

    Trainer(cfg).fit(watchers=[Goodput])   # `titanlite train` hands it in
    summarize(run_dir)                     # {"goodput", "wall_s", "productive_s", "lost_s", ...}

The `Goodput` watcher appends the job's timeline to <run dir>/goodput.jsonl (rank 0; restarted
attempts too), one JSON line per event: start (with when its process started); restore, step,
checkpoint (the seconds spent loading, stepping, blocked saving); end.

A step that was computed twice (done, lost in a failure before the next checkpoint, redone
after the restart) counts as productive only the last time; the earlier run of it is lost
work. Everything else - start-up, restarts, restores, checkpoint stalls, evaluation - is
overhead. goodput = productive / wall.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ...errors import TitanliteError, writing
from ...resilience.faults import attempt
from ...watchers import Run, StepEnd, Watcher


def process_start_time() -> float:
    """When this process started (epoch seconds; now, off Linux): start-up is part of a restart."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class GoodputLog:
    def __init__(self, run_dir: str | Path, enabled: bool = True):
        self.path, self.enabled, self.attempt = Path(run_dir) / "goodput.jsonl", enabled, attempt()
        self._write(event="start", process_start=process_start_time())

    def _write(self, **event) -> None:
        if self.enabled:
            with writing(self.path, "the goodput log"), open(self.path, "a") as f:
                f.write(json.dumps({"t": time.time(), "attempt": self.attempt, **event}) + "\n")

    def restore(self, step: int, seconds: float) -> None:
        self._write(event="restore", step=step, seconds=seconds)

    def step(self, step: int, seconds: float) -> None:
        self._write(event="step", step=step, seconds=seconds)

    def checkpoint(self, step: int, seconds: float) -> None:
        self._write(event="checkpoint", step=step, seconds=seconds)

    def end(self) -> None:
        self._write(event="end")


class Goodput(Watcher):
    """The job's timeline in goodput.jsonl (rank 0). A save's blocking time reaches it through the
    step's `extra` (the checkpoint watcher comes later in the chain), logged as the next step starts."""

    def __init__(self, run: Run):
        self.log = GoodputLog(run.run_dir, enabled=run.is_main)  # writes "start"
        self.last: StepEnd | None = None
        if run.restore_s is not None:
            self.log.restore(run.start_step, run.restore_s)

    def _saved(self) -> None:
        if self.last is not None:
            for key in ("checkpoint_blocked_s", "checkpoint_final_wait_s"):
                if key in self.last.extra:
                    self.log.checkpoint(self.last.step, self.last.extra.pop(key))

    def on_step_start(self, step: int) -> None:
        self._saved()

    def on_step_end(self, end: StepEnd) -> None:
        staging = end.out["staging_wait_s"]  # an async save's copy the step waited for
        self.log.step(end.step, end.seconds - staging)
        if staging:
            self.log.checkpoint(end.step, staging)
        self.last = end

    def on_train_end(self) -> None:
        self._saved()
        self.log.end()


def read_events(path: str | Path) -> list[dict]:
    """The events of a run directory's goodput.jsonl (or of that file), in order."""
    path = Path(path)
    path = path / "goodput.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise TitanliteError(
            f"{path} does not exist: pass the run directory of a titanlite run "
            f"(History.run_dir or LaunchResult.run_dir)"
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(path: str | Path) -> dict:
    """Wall time split into productive / lost / checkpoint / restore / other, and goodput."""
    events = read_events(path)
    starts = [e for e in events if e["event"] == "start"]
    if not starts:
        raise ValueError(f"{path} has no start event: not a goodput log")
    last_run: dict[int, float] = {}  # step -> seconds of its last (kept) computation
    total_steps = 0.0
    for e in events:
        if e["event"] == "step":
            last_run[e["step"]] = e["seconds"]
            total_steps += e["seconds"]
    productive = sum(last_run.values())
    wall = max(e["t"] for e in events) - min(s["process_start"] for s in starts)
    ckpt = sum(e["seconds"] for e in events if e["event"] == "checkpoint")
    restore = sum(e["seconds"] for e in events if e["event"] == "restore")
    lost = total_steps - productive
    return {
        "wall_s": wall,
        "productive_s": productive,
        "lost_s": lost,
        "checkpoint_s": ckpt,
        "restore_s": restore,
        "other_s": wall - productive - lost - ckpt - restore,
        "goodput": productive / wall if wall > 0 else 0.0,
        "attempts": len(starts),
        "failures": len(starts) - 1,
        "steps": max(last_run, default=0),
        "finished": events[-1]["event"] == "end",
    }
