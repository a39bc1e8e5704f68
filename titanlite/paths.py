"""Output folders the user names, checked before anything is written there: a log dir under a file
(else a NotADirectoryError deep inside torch, maybe after minutes of work), a folder holding another
run (else overwritten, its metrics mixed with the new run's). One line naming the path and the fix."""

import json
import os
import shutil
from pathlib import Path

from .errors import TitanliteError


def check_output_dir(path: str | Path, what: str) -> Path:
    """`path` is, or can become, a writable folder; returns it as a Path."""
    path = Path(path)
    existing = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    if not existing.is_dir():  # a regular file stands where a folder should be
        where = "it is" if existing == path else f"'{existing}' is"
        raise TitanliteError(
            f"{what} '{path}' cannot be a folder: {where} a file; "
            f"choose another path, or move that file away"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TitanliteError(
            f"{what} '{path}' is not writable ('{existing}' is read-only for "
            f"this user): choose a folder you can write to"
        )
    return path


def run_dir_refusal(run_dir: Path, info: dict, checkpoint, overwrite: bool) -> str | None:
    """Why a new run may not write into `run_dir`, a folder holding another run (None: it may): this
    job's own earlier attempt (the same info["job"]) or a resume of the same data, optimizer, schedule,
    seq_len and seed from a committed checkpoint may; with `overwrite` the old run is deleted instead."""
    if not (run_dir / "run.json").is_file() and not any(run_dir.glob("metrics*.jsonl")):
        return None
    old = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    if info.get("job") and old.get("job") == info["job"]:
        return None
    # What a resume must keep (the checkpoint itself checks the model and the global batch).
    was, now = (
        {
            f"{s}.{k}": v
            for s in ("data", "optimizer", "scheduler", "training")
            for k, v in (d.get("config") or {}).get(s, {}).items()
            if s != "training" or k in ("seq_len", "seed")
        }
        for d in (old, info)
    )
    differ = [f"{k} {was[k]} → {v}" for k, v in now.items() if k in was and v != was[k]]
    if checkpoint.enable and checkpoint.resume and not differ:
        from .resilience.checkpoint_files import committed  # DCP: runs with checkpoints only

        if committed(checkpoint.folder or run_dir / "checkpoints"):  # none if no such folder
            return None
    if overwrite:
        print(f"titanlite: metrics.overwrite: deleting the run in {run_dir} before this one starts")
        return shutil.rmtree(run_dir)
    why = (
        f"different {', '.join(differ)}"
        if differ
        else "no committed checkpoint to resume with --checkpoint.enable true"
    )
    return (
        f"run folder '{run_dir}' holds another run ({why}): choose another --metrics.run_name, or add "
        f"--metrics.overwrite true to delete that run (metrics.overwrite = True in Python)"
    )
