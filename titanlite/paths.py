"""Output paths the user names, checked before anything is written there.

    check_output_dir("runs/x", "metrics.log_dir")      # a folder we may create or write into
    check_new_output("out/model.pt", "export target")  # a file we may create or replace

Without these, a log dir under a regular file or an export target that is a directory fails
deep inside torch or transformers as a NotADirectoryError traceback, sometimes after minutes of
work. Here it is one line naming the path and the fix, before any work starts.
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import TitanliteError


def _blocking_file(path: Path) -> Path | None:
    """The regular file that stands where `path` or one of its parents should be a folder."""
    for p in [path, *path.parents]:
        if p.exists():
            return p if not p.is_dir() else None
    return None


def check_output_dir(path: str | Path, what: str) -> Path:
    """`path` is, or can become, a writable folder; returns it as a Path."""
    path = Path(path)
    blocker = _blocking_file(path)
    if blocker is not None:
        where = "it is" if blocker == path else f"'{blocker}' is"
        raise TitanliteError(f"{what} '{path}' cannot be a folder: {where} a file; "
                             f"choose another path, or move that file away")
    existing = next(p for p in [path, *path.parents, Path(".")] if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TitanliteError(f"{what} '{path}' is not writable ('{existing}' is read-only for "
                             f"this user): choose a folder you can write to")
    return path


def check_new_output(path: str | Path, what: str) -> Path:
    """`path` can be written as a file (an existing file is replaced, a folder never is)."""
    path = Path(path)
    if path.is_dir():
        raise TitanliteError(f"{what} '{path}' is an existing folder, not a file: name a file "
                             f"inside it, e.g. '{path / 'model.pt'}'")
    check_output_dir(path.parent, f"the folder of {what}")
    return path
