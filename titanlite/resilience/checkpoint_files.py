"""What a committed checkpoint is on disk, and how it is checked before anything loads it.

step-00000040/             committed: DCP's data files (one per rank, "__<rank>_0.distcp"),
    .metadata              DCP's index: which byte range of which file holds which shard
    titanlite.json         what was trained (model shape, layout) + every file's size & CRC
step-00000050.partial/     a save in progress, or one a crash interrupted: never loaded"""

import dataclasses
import json
import logging
import os
import shutil
import sys
import threading
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._compat.torch_internals import dcp_storage_info
from ..errors import TitanliteError

COMMIT_FILE = "titanlite.json"
STEP_DIR, PARTIAL = "step-{:08d}", ".partial"  # the folder names above: committed, being written


def step_dir(folder: Path, step: int, partial: bool = False) -> Path:
    return Path(folder) / (STEP_DIR.format(step) + (PARTIAL if partial else ""))


def step_of(path: Path) -> int:
    """The step a `step_dir` folder holds, committed or partial: 42 for step-00000042(.partial)."""
    return int(path.name.removesuffix(PARTIAL).removeprefix("step-"))


def committed(folder: str | Path, partial: bool = False) -> list[Path]:
    """Committed checkpoints in `folder` (none if it does not exist), oldest first; `partial`:
    the saves begun there and never committed instead (a crash, or one still being written)."""
    if partial:
        return sorted(Path(folder).glob("step-????????" + PARTIAL))
    return sorted(p for p in Path(folder).glob("step-????????") if (p / COMMIT_FILE).is_file())


def crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


RAW = "titanlite.raw"  # the mark of a tensor stored as its bytes (no pickle): RawReader reads it


def _done(value) -> Future:
    (future := Future()).set_result(value)
    return future


class DcpWriter(FileSystemWriter):
    """DCP's own file writer, in DCP's own format (`torch.distributed.checkpoint.load` reads it
    without titanlite); a `background` (async) one at the lowest CPU priority."""

    background = False

    def write_data(self, plan, planner) -> Future:
        # An async save's writer competes with training for the CPU: it runs at the lowest
        # priority, which Linux sets per thread (this one, and those it starts).
        if self.background and sys.platform.startswith("linux"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return self._write(plan, planner)

    def _write(self, plan, planner) -> Future:
        return super().write_data(plan, planner)


class RawWriter(DcpWriter):
    """DCP's file writer, each tensor as its own bytes in one file per rank (a torch.save per
    tensor cost ~0.25 s of CPU at the small preset); size and CRC-32 summed on another thread as
    the bytes go out (in "<file>.crc": the commit reads nothing back); the disk set to work on
    each 4 MiB as it comes. Marked so that DCP's stock reader refuses it: only RawReader reads it."""

    def _write(self, plan, planner) -> Future:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"  # DCP's name: "__<rank>_0.distcp"
        path = Path(self.path) / name
        crc = RunningCrc()
        results, size, synced_to, syncing = [], 0, 0, []
        # CRC (in order) and disk syncs (fsync on macOS) on their own threads; both are done,
        # and their errors raised, before the file counts as written.
        with open(path, "wb") as f, ThreadPoolExecutor(1) as syncs:
            for item in plan.items:
                raw = item.type != WriteItemType.BYTE_IO
                data = planner.resolve_data(item)
                view = memoryview(_tensor_bytes(data) if raw else data.getbuffer())
                f.write(view)
                crc.add(view)
                info = dcp_storage_info(name, size, view.nbytes, [RAW] if raw else None)
                results.append(WriteResult(item.index, view.nbytes, info))
                size += view.nbytes
                # one sync at a time: the next starts once the previous one is done
                if size - synced_to >= 4 << 20 and (not syncing or syncing[-1].done()):
                    f.flush()  # the disk starts on these 4 MiB while we go on
                    syncing.append(syncs.submit(getattr(os, "fdatasync", os.fsync), f.fileno()))
                    synced_to = size
            f.flush()
            os.fsync(f.fileno())
            for sync in syncing:
                sync.result()  # a failed background sync fails the save (fsync may not see it)
        Path(f"{path}.crc").write_text(json.dumps([size, crc.result()]))
        return _done(results)


class RunningCrc:
    """CRC-32 of a stream of buffers, summed in order on a thread of its own."""

    def __init__(self):
        self._pool, self._folds, self._value = ThreadPoolExecutor(1), [], 0

    def add(self, view: memoryview) -> None:
        self._folds.append(self._pool.submit(self._fold, view))

    def _fold(self, view: memoryview) -> None:
        self._value = zlib.crc32(view, self._value)

    def result(self) -> int:
        for fold in self._folds:
            fold.result()  # an error while summing fails the save
        self._pool.shutdown()
        return self._value


def _tensor_bytes(tensor: torch.Tensor):
    """A tensor's bytes as a NumPy uint8 array (on the CPU, contiguous)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


class RawReader(FileSystemReader):
    """DCP's file reader that also reads RawWriter's tensors, into a tensor of the dtype and shape the
    index gives; the rest (and earlier checkpoints' torch.save'd tensors) as DCP reads them."""

    def read_data(self, plan, planner) -> Future:
        raw = [
            RAW in (self.storage_data[r.storage_index].transform_descriptors or ())
            for r in plan.items
        ]
        super().read_data(
            dataclasses.replace(plan, items=[r for r, b in zip(plan.items, raw) if not b]), planner
        )
        for req in (r for r, b in zip(plan.items, raw) if b):
            info, where = self.storage_data[req.storage_index], req.storage_index
            # DCP's load planners keep the index: the entry's dtype and its chunks' shapes
            entry = planner.metadata.state_dict_metadata[where.fqn]
            sizes = next(c.sizes for c in entry.chunks if list(c.offsets) == list(where.offset))
            tensor = torch.empty(sizes, dtype=entry.properties.dtype)
            with open(Path(self.path) / info.relative_path, "rb") as f:
                f.seek(info.offset)
                if f.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != info.length:
                    raise ValueError(
                        f"{info.relative_path} ends before {where.fqn}'s bytes: truncated"
                    )
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                tensor = tensor.narrow(dim, start, length)  # the part this rank loads
            planner.commit_tensor(req, planner.resolve_tensor(req).detach().copy_(tensor))
        return _done(None)


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


def fsync(path: Path) -> None:
    """Flush a file, or a folder's list of names, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path, info: dict) -> None:
    """Make `tmp` (a whole save) the checkpoint `final`: record every file's size and CRC-32 with
    `info` (the step, what was trained) in the commit record, sync it, then rename (atomic in
    POSIX): before the rename there is no checkpoint, after it a whole one."""
    files = {
        f.name: size_and_crc(f) for f in sorted(tmp.iterdir()) if f.is_file() and f.suffix != ".crc"
    }
    record = tmp / COMMIT_FILE
    record.write_text(
        json.dumps({"format": 1, "time": time.time(), "files": files, **info}, indent=1)
    )
    fsync(record)
    if final.exists():  # the same step saved again (a resumed run): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync(final.parent)


def _damaged(path: Path, what: str) -> TitanliteError:
    """One line, with the fix: the checkpoint before it is whole (each is verified on its own)."""
    return TitanliteError(
        f"checkpoint '{path}' is damaged: {what}; delete that step folder to resume "
        f"from the previous checkpoint, or load an earlier one from {path.parent}"
    )


def verify(path: str | Path, crc: bool = True) -> dict:
    """The commit record of checkpoint `path`, once every file it lists has its size (and CRC-32)."""
    path = Path(path)
    if not path.exists():
        raise TitanliteError(
            f"checkpoint directory '{path}' does not exist: check the path, or "
            f"list the saved ones with titanlite.resilience.committed(<folder>)"
        )
    if not (path / COMMIT_FILE).is_file():
        raise TitanliteError(
            f"'{path}' is not a committed checkpoint (no {COMMIT_FILE}): its save "
            f"never finished; load an earlier one from {path.parent}"
        )
    try:  # a record titanlite did not write (a half-copied folder, an edit) is damage too
        info = json.loads((path / COMMIT_FILE).read_text())
        files = info["files"]
        int(info["step"])
        ok = isinstance(files, dict) and all(
            isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)
            for v in files.values()
        )
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
            raise _damaged(
                path, f"{name} has {actual} bytes, {size} were written (truncated copy?)"
            )
        if crc and crc32(f) != want:
            raise _damaged(path, f"{name} is corrupt (CRC-32 mismatch: {what})")
    return info


def _not_from_dcp(record: logging.LogRecord) -> bool:
    """DCP logs failed metadata reads' tracebacks on the root logger (torch 2.13): one line will do."""
    return "distributed" + os.sep + "checkpoint" not in record.pathname


def dcp_load(
    sd: dict, path: Path, *, crc_checked: bool, no_dist: bool = False, reader=None, planner=None
) -> None:
    """`dcp.load(sd, path)` (through `reader`/`planner` if given), quiet; a failure in one line: damage
    (index, or a skipped CRC) or a mismatch."""
    logging.getLogger().addFilter(_not_from_dcp)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notes on planners, process groups
            try:
                FileSystemReader(path).read_metadata()
            except Exception:  # any unreadable index is a damaged one
                raise _damaged(path, "its index .metadata cannot be read") from None
            try:
                dcp.load(
                    sd, storage_reader=reader or RawReader(path), planner=planner, no_dist=no_dist
                )
            except (Exception, dcp.api.CheckpointException) as e:  # the latter is a BaseException
                if not crc_checked:
                    verify(path, crc=True)  # damage shows here as one line
                # its last line naming an error, else its last line, else its type
                lines = [ln for ln in str(e).splitlines() if "Error" in ln or "error" in ln] or (
                    str(e).splitlines() or [type(e).__name__]
                )
                raise TitanliteError(
                    f"checkpoint '{path}' does not fit this run ({lines[-1].strip()[:300]}): "
                    "load it with the settings it was saved with, or start a new "
                    "checkpoint folder"
                ) from None
    finally:
        logging.getLogger().removeFilter(_not_from_dcp)
