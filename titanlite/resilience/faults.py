"""Failure injection: make one rank fail on purpose, the ways real jobs fail.

    --fault.kind exception --fault.rank 1 --fault.step 5

- exception: a Python error (a bug, a bad batch): the rank exits, torchrun stops the others.
- kill:      SIGKILL, no goodbye (a node crash, an out-of-memory kill).
- hang:      the rank stops making progress (a stuck NCCL call, a dead NIC); the others wait in
             their next collective until parallel.timeout_s, then fail: that is how hangs surface.
- slow:      the rank sleeps `slow_s` extra every step from `step` on (a straggler: thermal
             throttling, a noisy neighbour); everyone waits for it at each collective.
By default only the first attempt fails (TORCHELASTIC_RESTART_COUNT=0), so a restarted job can
resume and finish, as after a real, transient fault. `attempts = k` makes the first k attempts
fail, attempt a at step `step + a * step_gap` (several failures in one job, for goodput);
`during = "save"` strikes while a checkpoint is being written instead of as the step begins
(after this rank has handed its data over: rank 0 commits, so kill rank 0 to stop a commit).
"""
from __future__ import annotations

import os
import signal
import time

from ..errors import TitanliteError

KINDS = ("none", "exception", "kill", "hang", "slow")


class InjectedFailure(RuntimeError):
    """The exception `kind=exception` raises (a plain error, so it shows a real traceback)."""


def check_fault(fault, steps: int, world_size: int) -> None:
    if fault.kind == "none":
        return
    last = fault.step + (fault.attempts - 1) * fault.step_gap if fault.once else fault.step
    if not 1 <= fault.step <= steps or last > steps:
        where = f"fault.step={fault.step}" if last == fault.step else \
            f"the last injected failure (step {fault.step} + {fault.attempts - 1} x {fault.step_gap} = {last})"
        raise TitanliteError(f"{where} is outside this run's steps 1..{steps}: the "
                             f"failure would never happen; choose a step in that range")
    if not 0 <= fault.rank < world_size:
        raise TitanliteError(f"fault.rank={fault.rank} does not exist in a job of {world_size} "
                             f"process(es): choose 0..{world_size - 1}")


def attempt() -> int:
    """Which attempt of the job this is: 0, then 1 after torchrun's first restart, ..."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def inject_fault(fault, step: int, rank: int, phase: str = "step") -> None:
    """Called by the trainer as each step begins (step counts from 1), and with phase="save"
    while a checkpoint is being saved after that step."""
    if fault.kind == "none" or rank != fault.rank:
        return
    a = attempt()
    if fault.once and a >= fault.attempts:
        return
    at = fault.step + (a * fault.step_gap if fault.once else 0)
    if fault.kind == "slow":
        if step >= at and phase == "step":
            time.sleep(fault.slow_s)
        return
    if step != at or phase != fault.during:
        return
    if fault.kind == "exception":
        raise InjectedFailure(f"injected failure on rank {rank} at step {step} (fault.kind=exception)")
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        while True:
            time.sleep(1)
