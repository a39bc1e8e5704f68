"""Where a (re)started run picks up: its fixed run directory and its newest committed checkpoint
(torchrun --max-restarts reruns a failed job, which continues exactly from there)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from .._ui import say
from ..errors import TitanliteError


def run_name_for(cfg) -> str:
    if cfg.metrics.run_name:
        return cfg.metrics.run_name
    ck, restarts = cfg.checkpoint, os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    # A restarted attempt must find the first one's checkpoints: a name with the time would differ.
    if ck.enable and ck.resume and not ck.folder and int(restarts) > 0:
        raise TitanliteError(
            "auto-resume under torchrun --max-restarts needs a fixed run "
            "directory: set --metrics.run_name NAME (or --checkpoint.folder DIR)"
        )
    return f"{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}"


def open_checkpoint(
    checkpoint,
    run_dir: Path,
    train_state,
    parts,
    tokenizer,
    is_main: bool,
    start_from=None,
    tie_embeddings: bool = False,
):
    """(checkpointer `[checkpoint]` asks for or None, what was loaded or None, its seconds or None,
    the step to go on from). Loaded: the newest committed checkpoint, else `checkpoint.load`
    (into `train_state()`, a TrainState), else - a fresh start - `start_from`'s weights into
    `parts` (tools.hf_start). One it cannot take is refused before `run_dir` changes. Collective."""
    source = seconds = ckpt = None
    step = 0
    if checkpoint.enable or checkpoint.load:
        from .checkpoint import (
            Checkpointer,  # DCP (torch.distributed.checkpoint): runs that checkpoint
        )

        folder = Path(checkpoint.folder) if checkpoint.folder else run_dir / "checkpoints"
        ckpt = Checkpointer(
            folder,
            mode=checkpoint.mode,
            keep_latest_k=checkpoint.keep_latest_k,
            read_once=checkpoint.read_once,
            file_format=checkpoint.format,
        )
        source = (ckpt.latest() if checkpoint.enable and checkpoint.resume else None) or (
            Path(checkpoint.load) if checkpoint.load else None
        )
    if source is not None:
        start = time.perf_counter()
        step = ckpt.load(train_state(), source, crc=checkpoint.verify == "crc")
        seconds = time.perf_counter() - start
        if is_main:
            say(f"resumed from {source} at step {step}", None)
    elif start_from is not None:  # no titanlite checkpoint took precedence: a fresh start
        took = start_from.load(parts, tie_embeddings)
        if is_main:
            say(f"started from {start_from.path} ({took:.1f}s to load)", None)
    if checkpoint.enable and is_main and not (ckpt.folder / "tokenizer").is_dir():
        tokenizer.save_pretrained(str(ckpt.folder / "tokenizer"))  # for export_hf
    return (ckpt if checkpoint.enable else None), source, seconds, step
