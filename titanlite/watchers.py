"""What watches the training loop from the side. `Trainer.fit` calls every watcher at the same
named points, and none of them changes what the model computes (injected faults aside: failing
is their point), so the losses are the same with any of them on or off:

    on_train_start()          once, after the run was accepted (its resume checked)
    on_step_start(step)       before step `step` (counting from 1) runs
    on_step_end(end)          after it: a StepEnd with its time and train_step's result
    on_train_end()            once, after the last step; in reverse order, the way nested `with`
                              blocks unwind: the last save commits before the final sample
    close()                   always, failure or not

Each watcher is told what it needs - the run's facts (`Run`) and the few things it calls - and
never holds the trainer, so what it can touch is written in its constructor."""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import peaks
from ._ui import say
from .config import Config
from .metrics import History, TrainLog
from .resilience.faults import inject_fault


@dataclass(frozen=True)
class Run:
    """The facts of one run that watchers read (all of them, and nothing they could change)."""

    cfg: Config
    run_dir: Path
    rank: int
    world_size: int
    device: torch.device
    tokens_per_step: int  # the global batch's tokens
    flops_per_token: float
    compute_dtype: torch.dtype  # what the matmuls run in: the MFU peak's dtype
    peak: peaks.Peak | None  # the MFU denominator at the start; None: no peak finder handed in
    datasheet: peaks.Peak | None  # the vendor's figure, if a tool looked it up
    is_main: bool  # rank 0, the one that prints
    distributed: bool  # more than one rank
    start_step: int = 0  # a resumed run starts at its checkpoint's step
    restore_s: float | None = None  # and took this long to load it

    @classmethod
    def of(cls, trainer, run_dir: Path, restore_s: float | None = None) -> "Run":
        """The facts of `trainer`'s run into `run_dir` (copied: a watcher never holds the trainer)."""
        return cls(
            cfg=trainer.cfg,
            run_dir=run_dir,
            rank=trainer.dist.rank,
            world_size=trainer.dist.world_size,
            device=trainer.device,
            tokens_per_step=trainer.global_batch * trainer.cfg.training.seq_len,
            flops_per_token=trainer.flops_per_token,
            compute_dtype=trainer.compute_dtype,
            peak=trainer.peak,
            datasheet=trainer.datasheet_peak,
            is_main=trainer.dist.is_main,
            distributed=trainer.dist.distributed,
            start_step=trainer.step,
            restore_s=restore_s,
        )


@dataclass
class StepEnd:
    step: int  # the step just finished (1-based)
    seconds: float  # its wall time; only logged steps wait for the device (see Trainer.fit)
    out: dict  # train_step's result: loss and grad_norm are read on logged steps only
    logged: bool  # a train record is due at this step
    extra: dict = field(default_factory=dict)  # fields watchers add to this step's train record


class Watcher:
    def on_train_start(self) -> None: ...
    def on_step_start(self, step: int) -> None: ...
    def on_step_end(self, end: StepEnd) -> None: ...
    def on_train_end(self) -> None: ...
    def close(self) -> None: ...


def notify(watchers: list[Watcher], hook: str, *args) -> None:
    """Call `hook` (one of the names above) on each watcher in order; on_train_end in reverse."""
    for w in reversed(watchers) if hook == "on_train_end" else watchers:
        getattr(w, hook)(*args)


class Faults(Watcher):
    """Fails this rank on purpose as a step begins, when [fault] asks (resilience/faults.py)."""

    def __init__(self, run: Run):
        self.fault, self.rank = run.cfg.fault, run.rank

    def on_step_start(self, step: int) -> None:
        inject_fault(self.fault, step, self.rank)


class Samples(Watcher):
    """Text the model writes (`sample()`): before training, every `eval.sample_every` steps, at the end."""

    def __init__(self, run: Run, history: History, log: TrainLog, sample):
        self.history, self.log, self.sample = history, log, sample
        self.every, self.step = run.cfg.eval.sample_every, run.start_step

    def take(self) -> str:
        text = self.history.samples[self.step] = self.sample()
        return text

    on_train_start = on_train_end = take  # a sample before the first step and after the last

    def on_step_end(self, end: StepEnd) -> None:
        self.step = end.step
        if self.every and end.step % self.every == 0:
            self.log.say(f"[step {end.step}] {self.take()!r}")


class Checkpoints(Watcher):
    """Saves `train_state()` every `checkpoint.every` steps and at the last; the run is only
    done once its last (async) save has committed and the checkpointer is closed."""

    def __init__(self, run: Run, log: TrainLog, checkpointer, train_state):
        self.run, self.log, self.last = run, log, None
        self.checkpointer, self.train_state = checkpointer, train_state

    def on_step_end(self, end: StepEnd) -> None:
        self.last = end
        every = self.run.cfg.checkpoint.every
        if end.step == self.run.cfg.training.steps or (every > 0 and end.step % every == 0):
            # [fault] during="save" strikes before the commit
            saved = self.checkpointer.save(
                self.train_state(),
                end.step,
                before_commit=lambda: inject_fault(
                    self.run.cfg.fault, end.step, self.run.rank, phase="save"
                ),
            )
            # What training stood still for, for watchers that account for it (tools.measure.goodput).
            end.extra["checkpoint_blocked_s"] = saved.blocked_s
            self.log.emit(
                {
                    "kind": "checkpoint",
                    "step": end.step,
                    "blocked_s": saved.blocked_s,
                    "mode": saved.mode,
                }
            )

    def on_train_end(self) -> None:
        blocked = self.checkpointer.wait()
        self.checkpointer.close()
        if self.last is not None:
            self.last.extra["checkpoint_final_wait_s"] = blocked


class Evaluation(Watcher):
    """Validation loss (`evaluate()`) every `eval.every` steps and at the last."""

    def __init__(self, run: Run, log: TrainLog, evaluate):
        self.run, self.log, self.evaluate = run, log, evaluate

    def on_step_end(self, end: StepEnd) -> None:
        if end.step % self.run.cfg.eval.every == 0 or end.step == self.run.cfg.training.steps:
            self.log.emit(
                {
                    "kind": "val",
                    "step": end.step,
                    "val_loss": self.evaluate(),
                    "elapsed_s": self.log.elapsed(),
                }
            )


def build_watchers(
    run: Run,
    history: History,
    *,
    callbacks=(),
    extra=(),
    lr,
    precision,
    sample,
    evaluate,
    checkpointer=None,
    train_state=None,
    peaks=None,
) -> list[Watcher]:
    """The watchers a run's config asks for, after those `extra` makes from the run (tools handed in
    by the caller, such as the profiler, whose step must end with train_step, before evaluations
    and saves). Call it only once the run is accepted: creating them writes into the run directory."""
    log = TrainLog(run, history, callbacks, lr, precision, peaks)  # first: it creates the run dir
    chain: list[Watcher] = [
        *(make(run) for make in extra),
        *([Faults(run)] if run.cfg.fault.kind != "none" else []),
        log,
        Samples(run, history, log, sample),
        *([Checkpoints(run, log, checkpointer, train_state)] if checkpointer is not None else []),
        *([Evaluation(run, log, evaluate)] if run.cfg.eval.every else []),
    ]
    # Only a tool (the profiler) has `profiles`: none of the watchers above does.
    if (
        run.cfg.profile.steps
        and not any(getattr(w, "profiles", False) for w in chain)
        and run.is_main
    ):
        say(
            "profile.steps is set, but profiling is a tool: hand it to the loop with "
            "fit(watchers=[StepProfiler]) (titanlite.tools.measure.profiling); `titanlite train` does",
            None,
        )
    return chain
