"""Distributed checkpoints that are never half there: DCP save/load with an atomic commit.

    ckpt = Checkpointer("runs/x/checkpoints", mode="async", keep_latest_k=2)
    ckpt.save(state, step)        # returns after the blocking part; the write goes on behind
    step = ckpt.load(state)       # the newest complete checkpoint, verified, resharded to this run

A save goes to step-N.partial/, renamed step-N/ once whole (atomic in POSIX): a kill at any moment leaves the
last good checkpoint loadable; a load first checks every file's size and CRC-32. "sync" blocks training for the
whole write; "async" (a thread) and "async_process" (a process) copy the state to host memory in the background
(`wait_for_staging()`, into kept buffers) and write it behind training on their own gloo group (async_saves.py).
Three concerns, three places, as torchtitan's CheckpointManager splits them: staging (staging.py), saving
(`save` here, and async_saves.py behind training) and purging (`purge`, on the commit thread)."""

import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..distributed import env
from ..errors import TitanliteError, writing
from ..paths import check_output_dir
from .async_saves import AsyncSaves, SaveInFlight
from .balanced_io import BalancedSavePlanner, ReadOncePlanner, read_owners, share_read_entries
from .checkpoint_files import (
    DcpWriter,
    RawWriter,
    commit,
    committed,
    dcp_load,
    step_dir,
    step_of,
    verify,
)

MODES = ("sync", "async", "async_process")
# The formats, by the storage writer each is written with. dcp: torch's own file format, which
# `torch.distributed.checkpoint.load` (and torchtitan) read without titanlite; raw: each tensor as its
# bare bytes (ByteCheckpoint's choice: no pickle container per tensor, CRC as written), which only
# titanlite's reader reads (bench/checkpoint.py).
WRITERS = {"dcp": DcpWriter, "raw": RawWriter}
FORMATS = tuple(WRITERS)


class SaveTiming(NamedTuple):
    step: int
    blocked_s: float  # training stood still this long (for async: staging + the call)
    mode: str


class Checkpointer:
    """Saves into `folder`, keeps the newest `keep_latest_k` (0: all), loads the newest."""

    def __init__(
        self,
        folder: str | Path,
        *,
        mode: str = "sync",
        keep_latest_k: int = 2,
        describe: dict | None = None,
        read_once: bool = True,
        file_format: str = "dcp",
    ):
        if mode not in MODES:
            raise TitanliteError(f"checkpoint mode '{mode}' is not one of {MODES}")
        if file_format not in FORMATS:
            raise TitanliteError(f"checkpoint format '{file_format}' is not one of {FORMATS}")
        if (
            isinstance(keep_latest_k, bool)
            or not isinstance(keep_latest_k, int)
            or keep_latest_k < 0
        ):
            raise TitanliteError(
                f"keep_latest_k must be 0 (keep all) or a positive integer, got {keep_latest_k!r}"
            )
        self.folder = check_output_dir(folder, "checkpoint folder")
        self.mode, self.keep, self.read_once = mode, keep_latest_k, read_once
        self.writer = WRITERS[file_format]
        self.describe = describe or {}  # what was trained, if `state` cannot say: checked on load
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (
            (dist.get_rank(), dist.get_world_size()) if self.distributed else (0, 1)
        )
        # Commits of async saves, and every purge, run here one after another, behind training.
        self.commit_thread = ThreadPoolExecutor(1, thread_name_prefix="titanlite-commit")
        self.purging = None  # the purge a sync save left to the commit thread
        self.behind = (
            None if mode == "sync" else AsyncSaves(mode == "async_process", self.distributed)
        )

    def save(self, state, step: int, before_commit=None) -> SaveTiming:
        """Save `state` (dict or Stateful) as `step`; a rank runs `before_commit()` once its data is out."""
        start = time.perf_counter()
        tmp, final = step_dir(self.folder, step, partial=True), step_dir(self.folder, step)
        with writing(tmp, "a checkpoint"):  # a full disk: one line; the last commit stays whole
            if self.behind is not None:
                self.behind.make_room(step, self.folder)
            if self.rank == 0:
                self.folder.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
            if self.distributed:
                dist.barrier()  # every rank writes into a clean folder
            sd = state.state_dict() if hasattr(state, "state_dict") else state
            info = {
                "step": step,
                **(state.describe() if hasattr(state, "describe") else self.describe),
            }
            writer = self.writer(tmp, sync_files=True)
            writer.background = self.behind is not None
            if self.behind is None:
                self._save_now(sd, writer, tmp, final, info, before_commit)
            else:
                self._save_behind(sd, writer, tmp, final, info, before_commit)
        return SaveTiming(step, time.perf_counter() - start, self.mode)

    def _save_now(self, sd: dict, writer, tmp: Path, final: Path, info: dict, before_commit):
        """sync: training waits for the write and the commit; the purge goes on behind it."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notes on planners and deprecated names
            dcp.save(
                sd, storage_writer=writer, planner=BalancedSavePlanner(), no_dist=self.world == 1
            )
        if before_commit is not None:
            before_commit()
        if self._commit(tmp, final, info):
            self.purging = self.commit_thread.submit(purge, self.folder, self.keep, info["step"])
        if self.distributed:
            dist.barrier()  # everyone returns with the checkpoint committed

    def _save_behind(self, sd: dict, writer, tmp: Path, final: Path, info: dict, before_commit):
        """async: the copy begins now, the write after it; the commit thread commits it (and
        purges) once every rank's data is out."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notes on planners and deprecated names
            save = self.behind.start(sd, writer, info["step"])
        if before_commit is not None:
            before_commit()
        save.commit = self.commit_thread.submit(self._commit_when_written, save, tmp, final, info)

    def _commit_when_written(self, save: SaveInFlight, tmp: Path, final: Path, info: dict):
        """On the commit thread: once the write is done, commit, then purge here too (a failure
        fails this save's commit, in one line, when it is waited for)."""
        save.write.result()  # every rank's data is written, rank 0's .metadata too
        self.behind.one_write_done = True
        if self._commit(tmp, final, info):
            purge(self.folder, self.keep, info["step"])

    def _commit(self, tmp: Path, final: Path, info: dict) -> bool:
        """Rank 0: record every file's size and CRC, then rename: the checkpoint exists. Whether
        this rank committed (only rank 0 does)."""
        # A group torn down under a save still in flight (a peer died and this rank is exiting):
        # DCP then quietly saves this rank's shards alone, a checkpoint that resumes wrong. Seen
        # on a loaded CI machine: never commit it.
        if self.rank != 0 or (self.distributed and not dist.is_initialized()):
            return False
        commit(tmp, final, info)
        return True

    def wait_for_staging(self) -> float:
        """Async: block until the state has been copied out (call before weights change)."""
        return self.behind.wait_for_staging() if self.behind is not None else 0.0

    def wait(self) -> float:
        """Block until the save in flight (if any) is written and committed, and older ones purged."""
        start = time.perf_counter()
        if self.behind is not None:
            self.behind.wait(self.folder)
        if self.purging is not None:
            purging, self.purging = self.purging, None
            purging.result()
        return time.perf_counter() - start

    def latest(self) -> Path | None:
        return (committed(self.folder) or [None])[-1]

    def load(self, state, path: str | Path | None = None, crc: bool = True, reader=None) -> int:
        """Fill `state` from checkpoint `path` (default: the newest), resharded; returns its step.
        reader: a DCP storage reader for `path` (e.g. one that counts bytes: tools/measure/checkpoint_io.py)."""
        path = Path(path) if path is not None else self.latest()
        if path is None:
            raise TitanliteError(f"no committed checkpoint in '{self.folder}' to load")
        # Rank 0 verifies the files and tells everyone (N readers: N times the I/O).
        info = _verified(path, crc) if self.rank == 0 else None
        if isinstance(info := env.broadcast_from_rank0(info), TitanliteError):
            raise info
        here_info = state.describe() if hasattr(state, "describe") else self.describe
        saved, here = info.get("model_args"), here_info.get("model_args")
        if saved and here and saved != here:
            diff = ", ".join(
                f"{k}: {saved.get(k)} there vs {here.get(k)} here"
                for k in sorted(set(saved) | set(here))
                if saved.get(k) != here.get(k)
            )
            raise TitanliteError(
                f"checkpoint '{path}' holds a different model ({diff}): load it with the "
                f"model settings it was trained with, or start a new checkpoint folder"
            )
        # Before 2026-12 every checkpoint was AdamW's: a record without "optimizer" is one.
        was, now = info.get("optimizer", "adamw"), here_info.get("optimizer")
        if now and was != now:
            raise TitanliteError(
                f"checkpoint '{path}' holds {was}'s optimizer state, and this run asks for "
                f"--optimizer.name {now}: resume with --optimizer.name {was}, or start a new "
                f"checkpoint folder"
            )
        sd = state.state_dict() if hasattr(state, "state_dict") else state
        planner = (  # each replicated entry: one reader, then a broadcast
            ReadOncePlanner(read_owners(sd), self.rank)
            if self.read_once and self.distributed
            else None
        )
        dcp_load(sd, path, crc_checked=crc, reader=reader, planner=planner, no_dist=self.world == 1)
        if planner is not None:
            share_read_entries(sd, planner.owners)
        if hasattr(state, "load_state_dict"):
            state.load_state_dict(sd)
        return int(info["step"])

    def close(self) -> None:
        """Finish the save in flight; stop the background workers."""
        try:
            self.wait()
        finally:
            self.commit_thread.shutdown(wait=True)
            if self.behind is not None:
                self.behind.close()


def purge(folder: Path, keep: int, newest: int) -> None:
    """After step `newest` is committed: delete all but the newest `keep` committed checkpoints (0:
    keep all), each renamed *.deleting first (a crash mid-way never leaves a half-deleted folder
    that still looks committed), and the saves begun before it that never committed."""
    for old in committed(folder)[:-keep] if keep else []:
        gone = old.with_name(old.name + ".deleting")
        old.rename(gone)
        shutil.rmtree(gone, ignore_errors=True)
    for stale in committed(folder, partial=True):
        if step_of(stale) < newest:
            shutil.rmtree(stale, ignore_errors=True)


def _verified(path: Path, crc: bool) -> dict | TitanliteError:
    """The checkpoint's commit record once every file checks out, or why it does not."""
    try:
        return verify(path, crc=crc)
    except TitanliteError as e:
        return e
