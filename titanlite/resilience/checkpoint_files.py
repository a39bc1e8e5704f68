"""What a committed checkpoint is on disk, and how it is checked before anything loads it.

    step-00000040/             committed: DCP's data files (one per rank, "__<rank>_0.distcp"),
        .metadata              DCP's index: which byte range of which file holds which shard
        titanlite.json         what was trained (model shape, layout) + every file's size & CRC
    step-00000050.partial/     a save in progress, or one a crash interrupted: never loaded
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
import zlib
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

from ..errors import TitanliteError

COMMIT_FILE = "titanlite.json"


def step_dir(folder: Path, step: int) -> Path:
    return Path(folder) / f"step-{step:08d}"


def committed(folder: str | Path) -> list[Path]:
    """Committed checkpoints in `folder` (none if it does not exist), oldest first."""
    return sorted(p for p in Path(folder).glob("step-????????") if (p / COMMIT_FILE).is_file())


def crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


class CrcFileSystem(FileSystem):
    """DCP's file system, taking each data file's size and CRC-32 from the bytes as they are written
    (into "<file>.crc"), so the commit need not read the checkpoint back. `writer.fs = CrcFileSystem()`."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode or not str(path).endswith(".distcp"):
                yield stream
                return
            counted = _CrcWriter(stream)
            yield counted
        Path(f"{path}.crc").write_text(json.dumps([counted.size, counted.crc]))


class _CrcWriter:
    """A file, whose writes also update a running CRC-32 and byte count."""

    def __init__(self, file):
        self.file, self.crc, self.size = file, 0, 0

    def write(self, data) -> int:
        n = self.file.write(data)
        self.crc, self.size = zlib.crc32(data, self.crc), self.size + n
        return n

    def __getattr__(self, name):  # tell, flush, fileno (fsync), ...: the file's own
        return getattr(self.file, name)


def size_and_crc(f: Path) -> list[int]:
    """[bytes, CRC-32] of a data file: from its ".crc" note if the writer left one (then removed),
    else read back."""
    note = f.with_name(f.name + ".crc")
    if note.is_file():
        size, crc = json.loads(note.read_text())
        note.unlink()
        if size == f.stat().st_size:
            return [size, crc]
    return [f.stat().st_size, crc32(f)]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _damaged(path: Path, what: str) -> TitanliteError:
    """One line, with the fix: the checkpoint before it is whole (each is verified on its own)."""
    return TitanliteError(f"checkpoint '{path}' is damaged: {what}; delete that step folder to resume "
                          f"from the previous checkpoint, or load an earlier one from {path.parent}")


def verify(path: str | Path, crc: bool = True) -> dict:
    """The commit record of checkpoint `path`, once every file it lists has its size (and CRC-32)."""
    path = Path(path)
    if not path.exists():
        raise TitanliteError(f"checkpoint directory '{path}' does not exist: check the path, or "
                             f"list the saved ones with titanlite.resilience.committed(<folder>)")
    if not (path / COMMIT_FILE).is_file():
        raise TitanliteError(f"'{path}' is not a committed checkpoint (no {COMMIT_FILE}): its save "
                             f"never finished; load an earlier one from {path.parent}")
    try:  # a record titanlite did not write (a half-copied folder, an edit) is damage too
        info = json.loads((path / COMMIT_FILE).read_text())
        files = info["files"]
        int(info["step"])
        ok = isinstance(files, dict) and all(isinstance(v, list) and len(v) == 2
                                             and all(isinstance(x, int) for x in v) for v in files.values())
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise _damaged(path, f"its commit record {COMMIT_FILE} is not what titanlite writes")
    for name, (size, want) in files.items():
        f = path / name
        what = "DCP's index" if name == ".metadata" else "a shard written by one rank"
        if not f.is_file():
            raise _damaged(path, f"it is missing {name} ({what})")
        if (actual := f.stat().st_size) != size:
            raise _damaged(path, f"{name} has {actual} bytes, {size} were written (truncated copy?)")
        if crc and crc32(f) != want:
            raise _damaged(path, f"{name} is corrupt (CRC-32 mismatch: {what})")
    return info


def _not_from_dcp(record: logging.LogRecord) -> bool:
    """DCP logs failed metadata reads' tracebacks on the root logger (torch 2.13): one line will do."""
    return "distributed" + os.sep + "checkpoint" not in record.pathname


def dcp_load(sd: dict, path: Path, *, crc_checked: bool, no_dist: bool = False, reader=None,
             planner=None) -> None:
    """`dcp.load(sd, path)` (through `reader`/`planner` if given), quiet; a failure in one line: damage
    (index, or a skipped CRC) or a mismatch."""
    logging.getLogger().addFilter(_not_from_dcp)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notes on planners, process groups
            try:
                FileSystemReader(path).read_metadata()
            except Exception:  # noqa: BLE001 -- any unreadable index is a damaged one
                raise _damaged(path, "its index .metadata cannot be read") from None
            try:
                dcp.load(sd, checkpoint_id=path, storage_reader=reader, planner=planner, no_dist=no_dist)
            except (Exception, dcp.api.CheckpointException) as e:  # the latter is a BaseException
                if not crc_checked:
                    verify(path, crc=True)  # damage shows here as one line
                lines = [ln for ln in str(e).splitlines() if "Error" in ln or "error" in ln]
                first = (lines[-1] if lines else str(e).splitlines()[-1] if str(e) else type(e).__name__)
                raise TitanliteError(f"checkpoint '{path}' does not fit this run ({first.strip()[:300]}): "
                                     "load it with the settings it was saved with, or start a new "
                                     "checkpoint folder") from None
    finally:
        logging.getLogger().removeFilter(_not_from_dcp)
