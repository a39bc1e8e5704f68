"""Straggler detection from per-rank timings: a tool the command line hands to every
distributed run (`Trainer.fit(watchers=[Stragglers])`), and an offline reading of a job's records.

In synchronous training every rank waits for the slowest at each collective, so per-rank *step*
times all equal the straggler's. What differs is how long each rank took to get *ready*: the
time from the step's start to its first collective (loading the batch, host work, a noisy
neighbour, an injected `fault.kind=slow`). The trainer measures that per rank and gathers it;
a rank whose median over a window is well above the other ranks' median is a straggler.
(Stragglers inside the GPU's compute need device-side timings; this catches the host side.)
"""

from __future__ import annotations

import statistics
from collections import deque

import torch
import torch.distributed as dist

from ..._ui import say
from ...watchers import Run, StepEnd, Watcher


class StragglerDetector:
    def __init__(self, window: int = 5, ratio: float = 2.0, min_gap_s: float = 0.05):
        self.window, self.ratio, self.min_gap_s = window, ratio, min_gap_s
        self._history: deque[list[float]] = deque(maxlen=window)

    def update(self, ready_s_by_rank: list[float]) -> list[int]:
        """Add one step's per-rank ready times; return the ranks that are stragglers now
        (judged once the window is full)."""
        self._history.append(list(ready_s_by_rank))
        if len(self._history) < self.window:
            return []
        per_rank = [
            statistics.median(step[r] for step in self._history)
            for r in range(len(ready_s_by_rank))
        ]
        flagged = []
        for r, t in enumerate(per_rank):
            others = statistics.median(per_rank[:r] + per_rank[r + 1 :])  # judged against the rest
            if t > self.ratio * others and t - others > self.min_gap_s:
                flagged.append(r)
        return flagged


def gather_ready_times(ready_s: float, device) -> list[float]:
    """Every rank's time-to-first-collective of this step (one float each)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [ready_s]
    mine = torch.tensor([ready_s], device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [x.item() for x in everyone]


def detect_stragglers(records: list[dict], **kwargs) -> list[int]:
    """Offline: the straggler ranks of a finished job, from its per-rank train records (each
    with "rank" and "ready_s"), over the steps every rank logged."""
    by_step: dict[int, dict[int, float]] = {}
    for r in records:
        if r.get("kind") == "train" and "ready_s" in r:
            by_step.setdefault(r["step"], {})[r.get("rank", 0)] = r["ready_s"]
    ranks = sorted({rank for step in by_step.values() for rank in step})
    detector = StragglerDetector(**{"window": max(1, len(by_step)), **kwargs})
    flagged: list[int] = []
    for step in sorted(by_step):
        if set(by_step[step]) == set(ranks):
            flagged = detector.update([by_step[step][rank] for rank in ranks])
    return [ranks[i] for i in flagged]


class Stragglers(Watcher):
    """Gathers every rank's time-to-first-collective on logged steps and names the ranks that lag;
    the names go into rank 0's train records. Only logged steps: reading the gathered times back
    waits for the device, which an unlogged step never does (tools/measure/host_syncs.py counts)."""

    def __init__(self, run: Run):
        self.run = run
        self.detector = StragglerDetector()

    def on_step_end(self, end: StepEnd) -> None:
        if not end.logged:
            return
        ready = gather_ready_times(end.out["ready_s"], self.run.device)  # every rank takes part
        slow = self.detector.update(ready)
        if slow and self.run.is_main:
            say(
                f"[step {end.step}] straggler rank(s) {slow}: ready after "
                f"{', '.join(f'{ready[r]:.2f}s' for r in slow)} vs median "
                f"{sorted(ready)[len(ready) // 2]:.2f}s",
                None,
            )
        if self.run.is_main:
            end.extra.update(ready_s_by_rank=ready, stragglers=slow)
