"""Failure injection: make one rank fail on purpose, the ways real jobs fail, e.g. with
`--fault.kind exception --fault.rank 1 --fault.step 5`.

Kinds: exception (a Python error), kill (SIGKILL, as a node crash or an OOM kill), hang (the
others fail in their next collective after parallel.timeout_s: that is how hangs surface), slow
(`slow_s` extra per step from `step` on: a straggler). With `once`, only the first `attempts`
attempts fail, attempt a at step `step + a * step_gap`, so a restarted job can resume and finish.
`during = "save"` strikes while a checkpoint is written (rank 0 commits: kill it to stop a commit)."""

import os
import signal
import time

from ..errors import TitanliteError

KINDS = ("none", "exception", "kill", "hang", "slow")


class InjectedFailure(RuntimeError):
    """The exception `kind=exception` raises (a plain error, so it shows a real traceback)."""


def inject_fault(fault, step: int, rank: int, phase: str = "step") -> None:
    """Called as each step begins (step counts from 1), and with phase="save" while saving its checkpoint."""
    if fault.kind == "none" or rank != fault.rank:
        return
    a = attempt()
    if fault.once and a >= fault.attempts:
        return
    at = fault.step + (a * fault.step_gap if fault.once else 0)
    if fault.kind == "slow" and step >= at and phase == "step":
        time.sleep(fault.slow_s)
    if fault.kind == "slow" or step != at or phase != fault.during:
        return
    if fault.kind == "exception":
        raise InjectedFailure(
            f"injected failure on rank {rank} at step {step} (fault.kind=exception)"
        )
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while fault.kind == "hang":
        time.sleep(1)


def attempt() -> int:
    """Which attempt of the job this is: 0, then 1 after torchrun's first restart, ..."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def check_fault(fault, steps: int, world_size: int) -> None:
    if fault.kind == "none":
        return
    last = fault.step + (fault.attempts - 1) * fault.step_gap if fault.once else fault.step
    if not 1 <= fault.step <= steps or last > steps:
        where = (
            f"fault.step={fault.step}"
            if last == fault.step
            else "the last injected failure "
            f"(step {fault.step} + {fault.attempts - 1} x {fault.step_gap} = {last})"
        )
        raise TitanliteError(
            f"{where} is outside this run's steps 1..{steps}: the "
            f"failure would never happen; choose a step in that range"
        )
    if not 0 <= fault.rank < world_size:
        raise TitanliteError(
            f"fault.rank={fault.rank} does not exist in a job of {world_size} "
            f"process(es): choose 0..{world_size - 1}"
        )
