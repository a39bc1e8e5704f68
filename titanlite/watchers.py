"""What watches the training loop from the side. `Trainer.fit` calls every watcher at the same
named points, and none of them changes what the model computes (injected faults aside: failing
is their point), so the losses are the same with any of them on or off:

    on_train_start()          once, after the run was accepted (its resume checked)
    on_step_start(step)       before step `step` (counting from 1) runs
    on_step_end(end)          after it: a StepEnd with its time and train_step's result
    on_train_end()            once, after the last step; in reverse order, the way nested `with`
                              blocks unwind: the last save commits before the final sample,
                              and goodput's "end" is written last
    close()                   always, failure or not

    watchers = build_watchers(trainer, history, callbacks, restore_s)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from . import hardware
from ._ui import progress_bar, say
from .metrics import MetricsLogger
from .resilience.faults import attempt, inject_fault
from .resilience.goodput import GoodputLog
from .resilience.stragglers import StragglerDetector, gather_ready_times
from .resilience.train_state import TrainState


@dataclass
class StepEnd:
    step: int          # the step just finished (1-based)
    seconds: float     # its wall time; only logged steps wait for the device (see Trainer.fit)
    out: dict          # train_step's result: loss and grad_norm are read on logged steps only
    logged: bool       # a train record is due at this step
    extra: dict = field(default_factory=dict)  # fields watchers add to this step's train record


class Watcher:
    def on_train_start(self) -> None: ...
    def on_step_start(self, step: int) -> None: ...
    def on_step_end(self, end: StepEnd) -> None: ...
    def on_train_end(self) -> None: ...
    def close(self) -> None: ...


class Watchers(Watcher):
    """The watchers of one run, called in order (on_train_end in reverse)."""

    def __init__(self, watchers: list[Watcher]):
        self.watchers = watchers

    def on_train_start(self) -> None:
        for w in self.watchers:
            w.on_train_start()

    def on_step_start(self, step: int) -> None:
        for w in self.watchers:
            w.on_step_start(step)

    def on_step_end(self, end: StepEnd) -> None:
        for w in self.watchers:
            w.on_step_end(end)

    def on_train_end(self) -> None:
        for w in reversed(self.watchers):
            w.on_train_end()

    def close(self) -> None:
        for w in self.watchers:
            w.close()


class Faults(Watcher):
    """Fails this rank on purpose as a step begins, when [fault] asks (resilience/faults.py)."""

    def __init__(self, trainer):
        self.fault, self.rank = trainer.cfg.fault, trainer.dist.rank

    def on_step_start(self, step: int) -> None:
        inject_fault(self.fault, step, self.rank)


class Goodput(Watcher):
    """The job's timeline in goodput.jsonl (rank 0): what share of wall time became training."""

    def __init__(self, trainer, history, restore_s: float | None):
        self.log = GoodputLog(history.run_dir, enabled=trainer.dist.is_main)  # writes "start"
        self.trainer = trainer
        if restore_s is not None:
            self.log.restore(trainer.step, restore_s)

    def on_step_end(self, end: StepEnd) -> None:
        staging = end.out["staging_wait_s"]  # an async save's copy the step waited for
        self.log.step(end.step, end.seconds - staging)
        if staging:
            self.log.checkpoint(end.step, staging)

    def on_train_end(self) -> None:
        self.log.end()


class TrainLog(Watcher):
    """Where records go: metrics.jsonl (rank 0; metrics.rank<r>.jsonl elsewhere, since step
    times and memory differ per rank; a restarted attempt appends), the History, the callbacks,
    and the progress bar. Builds the train record of every logged step."""

    def __init__(self, trainer, history, callbacks):
        self.trainer, self.history, self.callbacks = trainer, history, callbacks
        metrics, main = trainer.cfg.metrics, trainer.dist.is_main
        self.logger = MetricsLogger(history.run_dir, tensorboard=metrics.tensorboard and main,
                                    filename="metrics.jsonl" if main else f"metrics.rank{trainer.dist.rank}.jsonl")
        self.bar = progress_bar(trainer.cfg.training.steps, enabled=metrics.progress and main,
                                initial=trainer.step)
        self.tokens_per_step = trainer.global_batch * trainer.cfg.training.seq_len
        self.start = None  # when the first step began
        self.lr = 0.0
        self.interval_s, self.interval_steps = 0.0, 0  # since the last train record

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def say(self, text: str) -> None:
        if self.trainer.dist.is_main:
            say(text, self.bar)

    def emit(self, record: dict) -> None:
        if self.trainer.dist.distributed:
            record["rank"] = self.trainer.dist.rank
        if attempt():
            record["attempt"] = attempt()
        self.logger.log(record)
        history = self.history
        {"train": history.train, "val": history.val}.get(record["kind"], history.checkpoints).append(record)
        for callback in self.callbacks:
            callback(record)

    def on_step_start(self, step: int) -> None:
        if self.start is None:
            self.start = time.perf_counter()
        hardware.reset_peak_memory(self.trainer.device)  # the peak of this step alone
        self.lr = self.trainer.scheduler.get_last_lr()[0]

    def on_step_end(self, end: StepEnd) -> None:
        # Steps between records do not wait for the device, so one step's time means little on
        # a GPU; the interval's average, ended by the logged step's wait, is honest.
        self.interval_s += end.seconds
        self.interval_steps += 1
        if end.logged:
            self.emit(self.train_record(end))
            self.interval_s, self.interval_steps = 0.0, 0
        if self.bar is not None:
            self.bar.update(1)
            if end.logged:
                self.bar.set_postfix(loss=f"{end.out['loss']:.3f}", tok_s=f"{self.history.train[-1]['tokens_per_sec']:,.0f}")

    def train_record(self, end: StepEnd) -> dict:
        trainer, out = self.trainer, end.out
        step_time = self.interval_s / self.interval_steps
        tps = self.tokens_per_step / step_time
        achieved = trainer.flops_per_token * tps / trainer.dist.world_size  # per device, as the peak is
        if not trainer.dist.distributed:  # ranks sharing a machine would disturb a re-measurement
            trainer.peak = hardware.recheck_peak(achieved, trainer.peak, trainer.device,
                                                 trainer.compute_dtype, say=self.say)
        record = {"kind": "train", "step": end.step, "loss": out["loss"], "lr": self.lr,
                  "grad_norm": out["grad_norm"], "tokens_per_sec": tps,
                  "mfu": hardware.mfu(achieved, trainer.peak),
                  # the figure published MFUs (torchtitan, nanoGPT, PaLM) use; None off the table
                  "mfu_datasheet": hardware.datasheet_mfu(achieved, trainer.device, trainer.compute_dtype),
                  "peak_memory_bytes": hardware.peak_memory_bytes(trainer.device),
                  **hardware.allocator_readings(trainer.device),  # reserved, retries (CUDA)
                  "step_time_s": step_time, "elapsed_s": self.elapsed(),
                  "tokens": end.step * self.tokens_per_step, "peak_label": trainer.peak.label,
                  "ready_s": out["ready_s"]}
        if trainer.dist.distributed:  # MFU is per device: the job's FLOPs over all peaks
            record.update(world_size=trainer.dist.world_size)
        record.update(end.extra)
        if trainer.precision.scaler.is_enabled():
            record.update(loss_scale=trainer.precision.scale, skipped=out["skipped"],
                          skipped_steps=trainer.precision.skipped_steps)
        return record

    def on_train_end(self) -> None:
        for callback in self.callbacks:
            if hasattr(callback, "on_train_end"):
                callback.on_train_end()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.logger.close()


class Stragglers(Watcher):
    """Gathers every rank's time-to-first-collective and names the ranks that lag
    (resilience/stragglers.py); the names go into rank 0's train records."""

    def __init__(self, trainer, log: TrainLog):
        self.trainer, self.log = trainer, log
        self.detector = StragglerDetector()

    def on_step_end(self, end: StepEnd) -> None:
        ready = gather_ready_times(end.out["ready_s"], self.trainer.device)  # every rank takes part
        slow = self.detector.update(ready)
        if slow:
            self.log.say(f"[step {end.step}] straggler rank(s) {slow}: ready after "
                         f"{', '.join(f'{ready[r]:.2f}s' for r in slow)} vs median "
                         f"{sorted(ready)[len(ready) // 2]:.2f}s")
        if self.trainer.dist.is_main:
            end.extra.update(ready_s_by_rank=ready, stragglers=slow)


class Samples(Watcher):
    """Text the model writes: before training, every `eval.sample_every` steps, and at the end."""

    def __init__(self, trainer, history, log: TrainLog):
        self.trainer, self.history, self.log = trainer, history, log
        self.every = trainer.cfg.eval.sample_every

    def take(self) -> str:
        text = self.history.samples[self.trainer.step] = self.trainer.sample()
        return text

    def on_train_start(self) -> None:
        self.take()

    def on_step_end(self, end: StepEnd) -> None:
        if self.every and end.step % self.every == 0:
            self.log.say(f"[step {end.step}] {self.take()!r}")

    def on_train_end(self) -> None:
        self.take()


class Checkpoints(Watcher):
    """Saves the TrainState every `checkpoint.every` steps and at the last; the run is only
    done once its last (async) save has committed."""

    def __init__(self, trainer, goodput: Goodput, log: TrainLog):
        self.trainer, self.goodput, self.log = trainer, goodput.log, log

    def due(self, step: int) -> bool:
        every = self.trainer.cfg.checkpoint.every
        return step == self.trainer.cfg.training.steps or (every > 0 and step % every == 0)

    def on_step_end(self, end: StepEnd) -> None:
        if not self.due(end.step):
            return
        trainer = self.trainer
        saved = trainer.checkpointer.save(  # [fault] during="save" strikes before the commit
            TrainState(trainer), end.step,
            before_commit=lambda: inject_fault(trainer.cfg.fault, end.step, trainer.dist.rank, phase="save"))
        self.goodput.checkpoint(end.step, saved.blocked_s)
        self.log.emit({"kind": "checkpoint", "step": end.step, "blocked_s": saved.blocked_s,
                       "mode": saved.mode})

    def on_train_end(self) -> None:
        blocked = self.trainer.checkpointer.wait()
        self.trainer.checkpointer.close()
        self.trainer.checkpointer = None
        self.goodput.checkpoint(self.trainer.step, blocked)


class Evaluation(Watcher):
    """Validation loss every `eval.every` steps and at the last (Trainer.evaluate)."""

    def __init__(self, trainer, log: TrainLog):
        self.trainer, self.log = trainer, log

    def on_step_end(self, end: StepEnd) -> None:
        every, steps = self.trainer.cfg.eval.every, self.trainer.cfg.training.steps
        if end.step % every == 0 or end.step == steps:
            self.log.emit({"kind": "val", "step": end.step, "val_loss": self.trainer.evaluate(),
                           "elapsed_s": self.log.elapsed()})


def build_watchers(trainer, history, callbacks=(), restore_s: float | None = None) -> Watchers:
    """The watchers a run's config asks for. Call it only once the run is accepted: creating
    them writes into the run directory (metrics.jsonl, goodput.jsonl)."""
    log = TrainLog(trainer, history, callbacks)
    goodput = Goodput(trainer, history, restore_s)
    chain: list[Watcher] = [Faults(trainer)] if trainer.cfg.fault.kind != "none" else []
    chain += [goodput]
    if trainer.dist.distributed:  # one process cannot straggle behind itself
        chain.append(Stragglers(trainer, log))
    chain += [log, Samples(trainer, history, log)]
    if trainer.checkpointer is not None:
        chain.append(Checkpoints(trainer, goodput, log))
    if trainer.cfg.eval.every:
        chain.append(Evaluation(trainer, log))
    if trainer.cfg.profile.steps:  # first: its step ends with train_step, before evals and saves
        from .profiling.watcher import StepProfiler  # (it imports this module)
        chain.insert(0, StepProfiler(trainer, history.run_dir))
    return Watchers(chain)

