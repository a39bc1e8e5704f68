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
    if cfg.metrics.run_name:
        return cfg.metrics.run_name
    checkpoint = cfg.checkpoint
    if checkpoint.enable and checkpoint.resume and not checkpoint.folder and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        # A restarted attempt must find the first one's checkpoints: a name with the time in
        # it would differ.
        raise TitanliteError("auto-resume under torchrun --max-restarts needs a fixed run "
                             "directory: set --metrics.run_name NAME (or --checkpoint.folder DIR)")
    return f"{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}"


def open_checkpoint(trainer, run_dir: Path) -> tuple[Path | None, float | None]:
    """Give `trainer` the checkpointer [checkpoint] asks for, and restore the newest committed
    checkpoint (this run's own, after a restart) or else `checkpoint.load` (e.g. another run's,
    resharded to this layout). Returns what was loaded and the seconds it took, or (None, None)
    for a fresh start. A checkpoint this run cannot take (another model, layout or global
    batch, a damaged file) is refused here, before anything in `run_dir` changes."""
    checkpoint = trainer.cfg.checkpoint
    if not (checkpoint.enable or checkpoint.load):
        return None, None
    folder = Path(checkpoint.folder) if checkpoint.folder else run_dir / "checkpoints"
    ckpt = Checkpointer(folder, mode=checkpoint.mode, keep_latest_k=checkpoint.keep_latest_k)
    source = ((ckpt.latest() if checkpoint.enable and checkpoint.resume else None)
              or (Path(checkpoint.load) if checkpoint.load else None))
    seconds = None
    if source is not None:
        start = time.perf_counter()
        ckpt.load(TrainState(trainer), source, crc=checkpoint.verify == "crc")
        seconds = time.perf_counter() - start
        if trainer.dist.is_main:
            say(f"resumed from {source} at step {trainer.step}", None)
    trainer.checkpointer = ckpt if checkpoint.enable else None
    if checkpoint.enable and trainer.dist.is_main and not (ckpt.folder / "tokenizer").is_dir():
        trainer.tokenizer.save_pretrained(str(ckpt.folder / "tokenizer"))  # for export_hf
    return source, seconds
