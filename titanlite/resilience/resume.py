"""Where a (re)started run picks up: its fixed run directory and its newest checkpoint.

torchrun --max-restarts starts the same command again after a failure; the trainer then finds
the checkpoints the failed attempt committed and continues from the newest, exactly.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from .._ui import say
from ..errors import TitanliteError
from .checkpoint import Checkpointer
from .train_state import TrainState


def run_name_for(cfg) -> str:
    m, c = cfg.metrics, cfg.checkpoint
    if m.run_name:
        return m.run_name
    if c.enable and c.resume and not c.folder and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        # A restarted attempt must find the first one's checkpoints: a name with the time in
        # it would differ.
        raise TitanliteError("auto-resume under torchrun --max-restarts needs a fixed run "
                             "directory: set --metrics.run_name NAME (or --checkpoint.folder DIR)")
    return f"{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}"


def open_checkpoint(trainer, run_dir: Path, goodput) -> Path | None:
    """Give `trainer` the checkpointer [checkpoint] asks for, and restore the newest committed
    checkpoint (this run's own, after a restart) or else `checkpoint.load` (e.g. another run's,
    resharded to this layout). Returns what was loaded, or None for a fresh start."""
    c = trainer.cfg.checkpoint
    if not (c.enable or c.load):
        return None
    ckpt = Checkpointer(Path(c.folder) if c.folder else run_dir / "checkpoints", mode=c.mode,
                        keep_latest_k=c.keep_latest_k)
    source = (ckpt.latest() if c.enable and c.resume else None) or (Path(c.load) if c.load else None)
    if source is not None:
        start = time.perf_counter()
        ckpt.load(TrainState(trainer), source, crc=c.verify == "crc")
        goodput.restore(trainer.step, time.perf_counter() - start)
        if trainer.dist.is_main:
            say(f"resumed from {source} at step {trainer.step}", None)
    trainer.checkpointer = ckpt if c.enable else None
    if c.enable and trainer.dist.is_main and not (ckpt.folder / "tokenizer").is_dir():
        trainer.tokenizer.save_pretrained(str(ckpt.folder / "tokenizer"))  # for export_hf
    return source
