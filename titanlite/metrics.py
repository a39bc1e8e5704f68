"""Per-step metrics: one JSON object per line (JSON Lines), optionally mirrored to TensorBoard.

JSONL because it is append-only (a crash loses at most the line being written), streams (a live
plot can tail it while another process trains) and needs no library to read. Record kinds:
"train" (one per logged step), "val" (one per evaluation), "checkpoint" (one per save)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from . import peaks
from .errors import TitanliteError, writing
from .memory import allocator_readings, peak_memory_bytes
from .paths import check_output_dir


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


def train_record(
    step: int,
    out: dict,
    *,
    lr: float,
    step_time: float,
    elapsed: float,
    tokens_per_step: int,
    achieved_flops: float,
    peak,
    datasheet,
    device,
    world_size: int,
    precision,
    extra: dict,
) -> dict:
    """The record of a logged step: its loss and gradient norm (`out`, train_step's result),
    speed, MFU against `peak`, memory, and what watchers added (`extra`)."""
    record = {
        "kind": "train",
        "step": step,
        "loss": out["loss"],
        "lr": lr,
        "grad_norm": out["grad_norm"],
        "tokens_per_sec": tokens_per_step / step_time,
        "mfu": peaks.mfu(achieved_flops, peak),
        # the figure published MFUs (torchtitan, nanoGPT, PaLM) use; None off the table
        "mfu_datasheet": achieved_flops / datasheet.flops if datasheet else None,
        "peak_memory_bytes": peak_memory_bytes(device),
        **allocator_readings(device),  # reserved, retries (CUDA)
        "step_time_s": step_time,
        "elapsed_s": elapsed,
        "tokens": step * tokens_per_step,
        "peak_label": peak.label,
        "ready_s": out["ready_s"],
    }
    if world_size > 1:  # MFU is per device: the job's FLOPs over all peaks
        record.update(world_size=world_size)
    record.update(extra)
    if precision.scaler.is_enabled():
        record.update(
            loss_scale=precision.scale,
            skipped=out["skipped"],
            skipped_steps=precision.skipped_steps,
        )
    return record


class MetricsLogger:
    def __init__(
        self, run_dir: str | Path, tensorboard: bool = False, filename: str = "metrics.jsonl"
    ):
        self.run_dir = check_output_dir(run_dir, "run folder (metrics.log_dir / metrics.run_name)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / filename
        with writing(self.path, "the metrics"):
            self._file = self.path.open("a", buffering=1)  # line-buffered: readers see whole lines
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import (
                    SummaryWriter,  # optional: tensorboard is not a dependency
                )
            except ImportError as e:  # tensorboard is a declared dependency, but be clear
                raise TitanliteError(
                    f"metrics.tensorboard=true needs the tensorboard package "
                    f"({e}): pip install tensorboard"
                ) from None
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        line = json.dumps(record, default=lambda x: x.item() if hasattr(x, "item") else str(x))
        with writing(self.path, "the metrics"):
            self._file.write(line + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if (
                    key != "step"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self._tb.add_scalar(
                        f"{record.get('kind', 'train')}/{key}", value, record["step"]
                    )

    def close(self) -> None:
        with writing(self.path, "the metrics"):  # closing flushes: a full disk can show here
            self._file.close()
        if self._tb is not None:
            self._tb.close()
