"""Distributed checkpoints that are never half there: DCP save/load with an atomic commit.

    ckpt = Checkpointer("runs/x/checkpoints", mode="async", keep_latest_k=2)
    ckpt.save(state, step)        # returns after the blocking part; the write goes on behind
    step = ckpt.load(state)       # the newest complete checkpoint, verified, resharded to this run

Layout on disk (one folder per step):
    step-00000040/             committed: DCP's data files (one per rank, "__<rank>_0.distcp"),
        .metadata              DCP's index: which byte range of which file holds which shard
        titanlite.json         what was trained (model shape, layout) + every file's size & CRC
    step-00000050.partial/     a save in progress, or one a crash interrupted: never loaded

The commit is a directory rename, which POSIX makes atomic: a kill at any moment leaves either
the old set of committed checkpoints or the new one. A committed folder is still checked file
by file before loading (sizes, CRC-32), so a truncated or damaged one fails with one clear line.

Modes: "sync" blocks training for the whole write. "async" (torch's `dcp.async_save`, thread)
blocks only to *stage* (copy the state to CPU memory; pinned for CUDA tensors) and writes in a background
thread on its own gloo group, so it never interleaves with training's collectives. The copy
itself also runs in the background: the trainer calls `wait_for_staging()` before the next
optimizer step changes the weights. "async_process" writes from a separate process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from .._compat.torch_internals import stop_dcp_writer_process
from ..errors import TitanliteError
from ..paths import check_output_dir

MODES = ("sync", "async", "async_process")
COMMIT_FILE = "titanlite.json"


def step_dir(folder: Path, step: int) -> Path:
    return Path(folder) / f"step-{step:08d}"


def committed(folder: str | Path) -> list[Path]:
    """Committed checkpoints in `folder`, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("step-????????") if (p / COMMIT_FILE).is_file())


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(path: str | Path, crc: bool = True) -> dict:
    """The commit record of a checkpoint folder, after checking that every file it lists is
    there with its size (and CRC-32). Raises one clear line otherwise."""
    path = Path(path)
    if not path.exists():
        raise TitanliteError(f"checkpoint directory '{path}' does not exist: check the path, or "
                             f"list the saved ones with titanlite.resilience.committed(<folder>)")
    record = path / COMMIT_FILE
    if not record.is_file():
        raise TitanliteError(f"'{path}' is not a committed checkpoint (no {COMMIT_FILE}): its save "
                             f"never finished; load an earlier one from {path.parent}")
    info = _read_record(record)
    for name, (size, want) in info["files"].items():
        f = path / name
        what = "DCP's index" if name == ".metadata" else "a shard written by one rank"
        if not f.is_file():
            raise TitanliteError(f"checkpoint '{path}' is damaged: it is missing {name} ({what}); "
                                 f"{_EARLIER.format(path=path)}")
        if f.stat().st_size != size:
            raise TitanliteError(f"checkpoint '{path}' is damaged: {name} has {f.stat().st_size} "
                                 f"bytes, {size} were written (truncated copy?); "
                                 f"{_EARLIER.format(path=path)}")
        if crc and _crc32(f) != want:
            raise TitanliteError(f"checkpoint '{path}' is damaged: {name} is corrupt (CRC-32 "
                                 f"mismatch: {what}); {_EARLIER.format(path=path)}")
    return info


# The fix for a damaged checkpoint: the one before it is whole (each is verified on its own).
_EARLIER = ("delete that step folder to resume from the previous checkpoint, or load an "
            "earlier one from {path.parent}")


def _read_record(record: Path) -> dict:
    """The commit record, or one line saying it is damaged (a half-copied folder, an edit)."""
    try:
        info = json.loads(record.read_text())
        files = info["files"]
        int(info["step"])
        ok = isinstance(files, dict) and all(
            isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)
            for v in files.values())
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise TitanliteError(f"checkpoint '{record.parent}' is damaged: its commit record "
                             f"{COMMIT_FILE} is not what titanlite writes; "
                             f"{_EARLIER.format(path=record.parent)}")
    return info


class _DropDcpLogs(logging.Filter):
    """DCP logs the tracebacks of failed metadata reads on the *root* logger before raising
    (torch 2.13); the error titanlite raises says it in one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "distributed" + os.sep + "checkpoint" not in record.pathname


def dcp_load(sd: dict, path: Path, *, crc_checked: bool, no_dist: bool = False) -> None:
    """`dcp.load(sd, path)`, quiet, with one line on failure: damaged files (found by reading
    the index, or by the CRC check a size-only verification skipped) or a mismatch."""
    from torch.distributed.checkpoint import FileSystemReader
    quiet = _DropDcpLogs()
    logging.getLogger().addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notes on planners, process groups
            try:
                FileSystemReader(path).read_metadata()
            except Exception:  # noqa: BLE001: any unreadable index is a damaged one
                raise TitanliteError(f"checkpoint '{path}' is damaged: its index .metadata cannot "
                                     f"be read; {_EARLIER.format(path=path)}") from None
            try:
                dcp.load(sd, checkpoint_id=path, no_dist=no_dist)
            except (Exception, dcp.api.CheckpointException) as e:  # the latter is a BaseException
                if not crc_checked:
                    verify(path, crc=True)  # damage shows here as one line
                lines = [ln for ln in str(e).splitlines() if "Error" in ln or "error" in ln]
                first = (lines[-1] if lines else str(e).splitlines()[-1] if str(e) else type(e).__name__)
                raise TitanliteError(f"checkpoint '{path}' does not fit this run "
                                     f"({first.strip()[:300]}): load it with the settings it was "
                                     f"saved with, or start a new checkpoint folder") from None
    finally:
        logging.getLogger().removeFilter(quiet)


# ----- staging: the copy an async save makes before training may change the weights ------

def tensor_device_types(state) -> set[str]:
    """The device types ("cuda", "cpu", ...) of every tensor in a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state  # a DTensor's shard
        return {local.device.type}
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        return set().union(*(tensor_device_types(v) for v in state)) if state else set()
    return set()


def staging_options(tensor_device_types) -> dict[str, bool]:
    """How to copy tensors of these device types to host memory in the background.

    Decided by where the tensors are, not by what the machine has: a CPU rank on a GPU host
    that pinned memory or made a CUDA stream would create a CUDA context (hundreds of MiB on
    GPU 0 per rank) for nothing. Pinned host memory and a side stream pay off only for CUDA
    tensors: the copy then runs asynchronously next to training's kernels."""
    cuda = "cuda" in set(tensor_device_types)
    return {"use_pinned_memory": cuda, "use_non_blocking_copy": cuda, "use_staging_stream": cuda}


def make_stager(options: dict[str, bool], shared_memory: bool = False) -> DefaultStager:
    """DCP's stager for these options; the caller closes it when the write is done."""
    torch_options = StagingOptions(use_pinned_memory=options["use_pinned_memory"],
                                   use_shared_memory=shared_memory, use_async_staging=True,
                                   use_non_blocking_copy=options["use_non_blocking_copy"])
    if options["use_staging_stream"]:
        return DefaultStager(torch_options)  # copies on its own CUDA stream, in a thread
    return HostStager(torch_options)


class HostStager(DefaultStager):
    """DefaultStager's copy, in a background thread, without an accelerator stream: torch's
    own async mode makes a `torch.Stream()` whenever the machine has an accelerator, whatever
    device the tensors are on."""

    def __init__(self, options: StagingOptions):
        super().__init__(dataclasses.replace(options, use_async_staging=False))
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="titanlite-staging")
        self._future = None

    def stage(self, state_dict, **kwargs):
        self._future = self._copier.submit(super().stage, state_dict, **kwargs)
        return self._future

    def synchronize_staging(self) -> None:
        if self._future is not None:
            self._future.result()

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        super().close()


@dataclass
class SaveTiming:
    step: int
    blocked_s: float  # training stood still this long (for async: staging + the call)
    mode: str


class Checkpointer:
    """Saves into `folder`, keeps the newest `keep_latest_k` (0: all), loads the newest."""

    def __init__(self, folder: str | Path, *, mode: str = "sync", keep_latest_k: int = 2,
                 describe: dict | None = None):
        if mode not in MODES:
            raise TitanliteError(f"checkpoint mode '{mode}' is not one of {MODES}")
        if isinstance(keep_latest_k, bool) or not isinstance(keep_latest_k, int) or keep_latest_k < 0:
            raise TitanliteError(f"keep_latest_k must be 0 (keep all) or a positive integer, "
                                 f"got {keep_latest_k!r}")
        self.folder, self.mode, self.keep = check_output_dir(folder, "checkpoint folder"), mode, keep_latest_k
        self.describe = describe or {}  # what was trained: checked against the loading run
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self._described = self.describe
        self._pending = None  # the background write + commit of an async save
        self._staging = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="titanlite-commit")
        self._pg, self._own_world = None, False
        self._quiet_writer_thread = mode == "async" and not self.distributed
        if self._quiet_writer_thread:
            _lone_process_note(hide=True)
        if mode == "async_process" and not self.distributed:
            # torch's writer process joins the default group: give a lone process a group of one.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._own_world = True
        elif mode != "sync" and self.distributed:
            # A group of its own, so the background write's collectives never interleave with
            # training's (torchtitan does the same).
            self._pg = dist.new_group(backend="gloo")

    # ----- saving -------------------------------------------------------------------------
    def save(self, state, step: int, before_commit=None) -> SaveTiming:
        """Write `state` (a dict or Stateful) as checkpoint `step`. `before_commit()` runs on
        every rank once its data is handed over (failure injection uses it)."""
        start = time.perf_counter()
        self.wait()  # one save in flight at a time: the previous one commits first
        final = step_dir(self.folder, step)
        tmp = final.with_name(final.name + ".partial")
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        self._barrier()
        sd = state.state_dict() if hasattr(state, "state_dict") else state
        self._described = state.describe() if hasattr(state, "describe") else self.describe
        # Two writer threads per rank (two files each): one thread leaves the disk idle while
        # it serialises (measured here: 0.43 s -> 0.32 s for the small preset's 157 MiB).
        writer = dcp.FileSystemWriter(tmp, sync_files=True, thread_count=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notes on planners and deprecated names
            if self.mode == "sync":
                dcp.save(sd, storage_writer=writer)
                done = None
            else:
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
                stager = make_stager(staging_options(tensor_device_types(sd)),
                                     shared_memory=self.mode == "async_process")
                kind = AsyncCheckpointerType.PROCESS if self.mode == "async_process" else AsyncCheckpointerType.THREAD
                try:
                    response = dcp.async_save(sd, storage_writer=writer, process_group=self._pg,
                                              async_checkpointer_type=kind, async_stager=stager)
                except BaseException:
                    stager.close()
                    raise
                self._staging, done = response.staging_completion, response.upload_completion
        if before_commit is not None:
            before_commit()
        if done is None:
            self._commit(tmp, final, step)
            if self.distributed:
                self._barrier()  # everyone returns with the checkpoint committed
        else:
            self._pending = self._pool.submit(self._finish, done, tmp, final, step, stager)
        return SaveTiming(step, time.perf_counter() - start, self.mode)

    def wait_for_staging(self) -> float:
        """Async: block until the state has been copied out (call before weights change)."""
        if self._staging is None:
            return 0.0
        start = time.perf_counter()
        self._staging.result()
        self._staging = None
        return time.perf_counter() - start

    def wait(self) -> float:
        """Block until the save in flight (if any) is written and committed."""
        start = time.perf_counter()
        self.wait_for_staging()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises a failed background write here
        return time.perf_counter() - start

    def _finish(self, done, tmp: Path, final: Path, step: int, stager) -> None:
        try:
            done.result()  # every rank's data is written and rank 0 wrote .metadata
        finally:
            stager.close()  # its copy thread and (pinned) staging buffers: the write is over
        self._commit(tmp, final, step)

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        """Rank 0: record every file's size and CRC, then rename: the checkpoint exists."""
        if self.rank != 0:
            return
        files = {f.name: [f.stat().st_size, _crc32(f)] for f in sorted(tmp.iterdir()) if f.is_file()}
        info = {"format": 1, "step": step, "time": time.time(), "files": files, **self._described}
        record = tmp / COMMIT_FILE
        record.write_text(json.dumps(info, indent=1))
        with open(record, "rb+") as f:
            os.fsync(f.fileno())
        if final.exists():  # the same step saved again (a resumed run): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.folder)
        # Deleting old checkpoints need not stall training: the commit thread does it (a
        # sync save's commit runs here, so hand it over).
        if threading.current_thread() is threading.main_thread():
            self._pool.submit(self._prune, step)
        else:
            self._prune(step)

    def _prune(self, newest: int) -> None:
        keep = committed(self.folder)[-self.keep:] if self.keep else committed(self.folder)
        for old in committed(self.folder):
            if old not in keep:
                gone = old.with_name(old.name + ".deleting")  # never a half-deleted "committed" one
                os.rename(old, gone)
                shutil.rmtree(gone, ignore_errors=True)
        for stale in self.folder.glob("step-*.partial"):
            if int(stale.name[5:13]) < newest:
                shutil.rmtree(stale, ignore_errors=True)

    # ----- loading ------------------------------------------------------------------------
    def latest(self) -> Path | None:
        found = committed(self.folder)
        return found[-1] if found else None

    def load(self, state, path: str | Path | None = None, crc: bool = True) -> int:
        """Fill `state` from checkpoint `path` (default: the newest committed one); returns its
        step. Every rank reads the pieces its own layout needs (resharding)."""
        path = Path(path) if path is not None else self.latest()
        if path is None:
            raise TitanliteError(f"no committed checkpoint in '{self.folder}' to load")
        info = self._verify_once(path, crc)
        self._check_compatible(path, info, state.describe() if hasattr(state, "describe") else self.describe)
        sd = state.state_dict() if hasattr(state, "state_dict") else state
        dcp_load(sd, path, crc_checked=crc)
        if hasattr(state, "load_state_dict"):
            state.load_state_dict(sd)
        return int(info["step"])

    def _verify_once(self, path: Path, crc: bool) -> dict:
        """Rank 0 reads the files for the check and tells everyone the verdict (N ranks each
        reading the whole checkpoint would multiply the I/O by N)."""
        if not self.distributed:
            return verify(path, crc=crc)
        box = [None]
        if self.rank == 0:
            try:
                box[0] = verify(path, crc=crc)
            except TitanliteError as e:
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], TitanliteError):
            raise box[0]
        return box[0]

    @staticmethod
    def _check_compatible(path: Path, info: dict, describe: dict) -> None:
        saved, here = info.get("model_args"), describe.get("model_args")
        if saved and here and saved != here:
            diff = ", ".join(f"{k}: {saved.get(k)} there vs {here.get(k)} here"
                             for k in sorted(set(saved) | set(here)) if saved.get(k) != here.get(k))
            raise TitanliteError(f"checkpoint '{path}' holds a different model ({diff}): load it "
                                 f"with the model settings it was trained with, or start a new "
                                 f"checkpoint folder")

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        """Finish the save in flight; stop the background workers."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self.mode == "async_process":
                stop_writer_process()
            if self._quiet_writer_thread:
                self._quiet_writer_thread = False
                _lone_process_note(hide=False)
            if self._pg is not None:
                dist.destroy_process_group(self._pg)
                self._pg = None
            if self._own_world:
                dist.destroy_process_group()
                self._own_world = False


def stop_writer_process() -> None:
    """End the writer process `async_process` saves spawned (torch keeps one per Python process
    and has no public way to stop it; see titanlite._compat.torch_internals)."""
    stop_dcp_writer_process()


# DCP's background writer thread warns "torch.distributed is disabled, ... assuming the intent
# is to save in a single process" on every async save of a lone process: true, and no news. A
# catch_warnings() here cannot reach torch's thread, so while an async Checkpointer of a lone
# process is open this one filter hides exactly that message; close() takes it out again.
_NOTE = ("ignore", re.compile("torch.distributed is disabled", re.I), Warning, None, 0)
_note_users = 0
_note_lock = threading.Lock()


def _lone_process_note(hide: bool) -> None:
    global _note_users
    with _note_lock:
        _note_users += 1 if hide else -1
        if hide and _note_users == 1:
            warnings.filterwarnings("ignore", message=_NOTE[1].pattern)
        elif not hide and _note_users == 0:
            with contextlib.suppress(ValueError):
                warnings.filters.remove(_NOTE)
