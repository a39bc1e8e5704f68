"""Where a (re)started run picks up: its fixed run directory and its newest committed checkpoint
(torchrun --max-restarts reruns a failed job, which continues exactly from there)."""

import os
import time
from dataclasses import dataclass
from pathlib import Path

from .._ui import say
from ..distributed import env
from ..errors import TitanliteError
from ..paths import run_dir_refusal


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


def claim_run_dir(run_dir: Path, record: dict, cfg, is_main: bool) -> None:
    """Rank 0 claims `run_dir` for this run (paths.run_dir_refusal: why it may not, if it may
    not); every rank refuses, or none. Collective: every rank calls it."""
    refusal = (
        run_dir_refusal(run_dir, record, cfg.checkpoint, cfg.metrics.overwrite) if is_main else None
    )
    if refusal := env.broadcast_from_rank0(refusal):
        raise TitanliteError(refusal)


@dataclass
class Opened:
    """Where a run starts: `checkpointer` (None unless [checkpoint] enable), the checkpoint it loaded
    (`source`, None for a fresh start) and how long that took, and the step to go on from."""

    checkpointer: object | None = None
    source: Path | None = None
    seconds: float | None = None
    step: int = 0


def open_checkpoint(checkpoint, run_dir: Path, trainer) -> Opened:
    """Where `trainer` starts, as [checkpoint] says: the newest committed checkpoint loaded, else
    `checkpoint.load` (into `trainer.train_state()`, a TrainState), else - a fresh start - the
    published model `trainer.start_from`'s weights into its model parts (tools.formats.hf_start). One it
    cannot take is refused before `run_dir` changes. Collective: every rank calls it."""
    is_main = trainer.dist.is_main
    opened, ckpt = Opened(), None
    if checkpoint.enable or checkpoint.load:
        from .checkpoint import Checkpointer  # DCP (torch.distributed.checkpoint): runs that save

        ckpt = Checkpointer(
            checkpoint.folder or run_dir / "checkpoints",
            mode=checkpoint.mode,
            keep_latest_k=checkpoint.keep_latest_k,
            read_once=checkpoint.read_once,
            file_format=checkpoint.format,
        )
        newest = ckpt.latest() if checkpoint.enable and checkpoint.resume else None
        opened.source = newest or (Path(checkpoint.load) if checkpoint.load else None)
    if opened.source is not None:
        start = time.perf_counter()
        opened.step = ckpt.load(
            trainer.train_state(), opened.source, crc=checkpoint.verify == "crc"
        )
        opened.seconds = time.perf_counter() - start
        if is_main:
            say(f"resumed from {opened.source} at step {opened.step}", None)
    elif trainer.start_from is not None:  # no titanlite checkpoint came first: a fresh start
        took = trainer.start_from.load(trainer.model_parts, trainer.model_args.tie_embeddings)
        if is_main:
            say(f"started from {trainer.start_from.label} ({took:.1f}s to load)", None)
    if checkpoint.enable:
        opened.checkpointer = ckpt
        if is_main and not (ckpt.folder / "tokenizer").is_dir():
            trainer.tokenizer.save_pretrained(str(ckpt.folder / "tokenizer"))  # for export_hf
    return opened
