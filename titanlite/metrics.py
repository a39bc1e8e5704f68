"""Per-step metrics: one JSON object per line (JSON Lines), optionally mirrored to TensorBoard.

JSONL because it is append-only (a crash loses at most the line being written), streams (a live
plot can tail it while another process trains) and needs no library to read. Record kinds:
"train" (one per logged step), "val" (one per evaluation), "checkpoint" (one per save).
`TrainLog` is the watcher that writes them (and draws the progress bar)."""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import peaks
from ._ui import progress_bar, say
from .errors import TitanliteError, writing
from .memory import allocator_readings, peak_memory_bytes, reset_peak_memory
from .paths import check_output_dir
from .resilience.faults import attempt


@dataclass
class History:
    """What `fit()` returns: the records it logged, plus text samples before and after."""

    train: list[dict] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    samples: dict[int, str] = field(default_factory=dict)
    run_dir: Path | None = None
    checkpoints: list[dict] = field(default_factory=list)  # what each save cost
    resumed_from: Path | None = None

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.train]

    @property
    def val_losses(self) -> list[float]:
        return [r["val_loss"] for r in self.val]


class TrainLog:
    # A watcher (watchers.py) like the others, defined here beside what it writes. It is handed
    # the run's facts (`run`, a watchers.Run) and each step's end (`end`, a watchers.StepEnd);
    # watchers.py imports this module, so this one names those types only in words (no circle).
    """Where records go: metrics.jsonl (metrics.rank<r>.jsonl off rank 0: step times and memory
    differ per rank; a restarted attempt appends), TensorBoard if asked, the History, the
    callbacks, the progress bar. `lr()`: the learning rate of the step about to run; `precision`:
    the run's Precision (loss scale); `peaks`: the peak finder the trainer was handed, if any."""

    def __init__(self, run, history: History, callbacks, lr, precision, peaks=None):
        self.run, self.history, self.callbacks, self.peaks = run, history, callbacks, peaks
        self.lr_now, self.precision, self.lr = lr, precision, 0.0
        run_dir = check_output_dir(run.run_dir, "run folder (metrics.log_dir / metrics.run_name)")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / ("metrics.jsonl" if run.is_main else f"metrics.rank{run.rank}.jsonl")
        with writing(self.path, "the metrics"):
            self.file = self.path.open("a", buffering=1)  # line-buffered: readers see whole lines
        self.tensorboard = None
        if run.cfg.metrics.tensorboard and run.is_main:
            try:
                from torch.utils.tensorboard import (
                    SummaryWriter,  # optional: tensorboard is not a dependency
                )
            except ImportError as e:  # tensorboard is a declared dependency, but be clear
                raise TitanliteError(
                    f"metrics.tensorboard=true needs the tensorboard package "
                    f"({e}): pip install tensorboard"
                ) from None
            self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.bar = progress_bar(
            run.cfg.training.steps,
            enabled=run.cfg.metrics.progress and run.is_main,
            initial=run.start_step,
        )
        self.peak = run.peak  # re-measured if a step beats it (matmul_peak.recheck_peak)
        self.start = None  # when the first step began
        self.interval_s, self.interval_steps = 0.0, 0  # since the last train record

    def on_train_start(self) -> None: ...

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def say(self, text: str) -> None:
        if self.run.is_main:
            say(text, self.bar)

    def emit(self, record: dict) -> None:
        if self.run.distributed:
            record["rank"] = self.run.rank
        if attempt():
            record["attempt"] = attempt()
        line = json.dumps(record, default=lambda x: x.item() if hasattr(x, "item") else str(x))
        with writing(self.path, "the metrics"):
            self.file.write(line + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if (
                    key != "step"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self.tensorboard.add_scalar(f"{record['kind']}/{key}", value, record["step"])
        history = {"train": self.history.train, "val": self.history.val}  # else checkpoints
        history.get(record["kind"], self.history.checkpoints).append(record)
        for callback in self.callbacks:
            callback(record)

    def on_step_start(self, step: int) -> None:
        if self.start is None:
            self.start = time.perf_counter()
        reset_peak_memory(self.run.device)  # the peak of this step alone
        self.lr = self.lr_now()

    def on_step_end(self, end) -> None:
        # Steps between records do not wait for the device, so one step's time means little on
        # a GPU; the interval's average, ended by the logged step's wait, is honest.
        self.interval_s, self.interval_steps = (
            self.interval_s + end.seconds,
            self.interval_steps + 1,
        )
        if end.logged:
            self.emit(self.train_record(end))
            self.interval_s, self.interval_steps = 0.0, 0
        if self.bar is not None:
            self.bar.update(1)
            if end.logged:
                self.bar.set_postfix(
                    loss=f"{end.out['loss']:.3f}",
                    tok_s=f"{self.history.train[-1]['tokens_per_sec']:,.0f}",
                )

    def train_record(self, end) -> dict:
        """The record of a logged step: its loss and gradient norm (`end.out`, train_step's
        result), speed, MFU against the peak, memory, and what watchers added (`end.extra`)."""
        run, out = self.run, end.out
        step_time = self.interval_s / self.interval_steps
        # per device
        achieved = run.flops_per_token * run.tokens_per_step / step_time / run.world_size
        # A step beat the peak: it was measured on a busy machine. The peak finder measures it
        # again (ranks sharing a machine would disturb a re-measurement: only a lone process).
        if self.peaks and self.peak and achieved > self.peak.flops and not run.distributed:
            self.peak = self.peaks.beaten(
                achieved, self.peak, run.device, run.compute_dtype, self.say, run.datasheet
            )
        record = {
            "kind": "train",
            "step": end.step,
            "loss": out["loss"],
            "lr": self.lr,
            "grad_norm": out["grad_norm"],
            "tokens_per_sec": run.tokens_per_step / step_time,
            "mfu": peaks.mfu(achieved, self.peak) if self.peak else None,  # no peak finder: none
            # the figure published MFUs (torchtitan, nanoGPT, PaLM) use; None off the table
            "mfu_datasheet": achieved / run.datasheet.flops if run.datasheet else None,
            "peak_memory_bytes": peak_memory_bytes(run.device),
            **allocator_readings(run.device),  # reserved, retries (CUDA)
            "step_time_s": step_time,
            "elapsed_s": self.elapsed(),
            "tokens": end.step * run.tokens_per_step,
            "peak_label": self.peak.label if self.peak else None,
            "ready_s": out["ready_s"],
        }
        if run.distributed:  # MFU is per device: the job's FLOPs over all peaks
            record["world_size"] = run.world_size
        record.update(end.extra)
        if self.precision.scaler.is_enabled():
            record.update(
                loss_scale=self.precision.scale,
                skipped=bool(out["skipped"]),  # a device bool, read on logged steps only
                skipped_steps=int(self.precision.skipped_steps),
            )
        return record

    def on_train_end(self) -> None:
        for callback in self.callbacks:
            if hasattr(callback, "on_train_end"):
                callback.on_train_end()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        with writing(self.path, "the metrics"):  # closing flushes: a full disk can show here
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
