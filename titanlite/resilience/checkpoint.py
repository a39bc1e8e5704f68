"""Distributed checkpoints that are never half there: DCP save/load with an atomic commit.

    ckpt = Checkpointer("runs/x/checkpoints", mode="async", keep_latest_k=2)
    ckpt.save(state, step)        # returns after the blocking part; the write goes on behind
    step = ckpt.load(state)       # the newest complete checkpoint, verified, resharded to this run

A save goes to step-N.partial/, renamed step-N/ once whole (atomic in POSIX): a kill at any moment leaves the
last good checkpoint loadable; a load first checks every file's size and CRC-32. "sync" blocks training for the
whole write; "async" (a thread) and "async_process" (a process) copy the state to host memory in the background
(`wait_for_staging()`, into kept buffers) and write it behind training on their own gloo group."""

import shutil
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from .._compat.torch_internals import stop_dcp_writer_process
from ..errors import TitanliteError, writing
from ..paths import check_output_dir
from .balanced_io import BalancedSavePlanner, ReadOncePlanner, read_owners, share_read_entries
from .checkpoint_files import DcpWriter, RawWriter, commit, committed, dcp_load, step_dir, verify
from .staging import WriteAfter, make_stager, staging_options, tensor_device_types

MODES = ("sync", "async", "async_process")
# dcp: torch's own file format, which `torch.distributed.checkpoint.load` (and torchtitan) read
# without titanlite; raw: each tensor as its bare bytes (ByteCheckpoint's choice: no pickle
# container per tensor, CRC as written), which only titanlite's reader reads (bench/checkpoint.py).
FORMATS = ("dcp", "raw")


class SaveTiming(NamedTuple):
    step: int
    blocked_s: float  # training stood still this long (for async: staging + the call)
    mode: str


@dataclass
class SaveInFlight:
    """An async save not yet committed: its staging copy, DCP's write of it, the commit after it."""

    step: int
    stager: object  # the buffers the copy went to, busy until the write is done
    write: Future  # every rank's bytes are on disk (DCP's upload_completion)
    commit: Future | None = None  # rank 0 recorded and renamed it; None if before_commit raised


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
        self.mode, self.keep, self.file_format = mode, keep_latest_k, file_format
        self.describe = self._described = describe or {}  # what was trained: checked on load
        self.read_once = read_once
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (
            (dist.get_rank(), dist.get_world_size()) if self.distributed else (0, 1)
        )
        self._staging = None  # the newest async save's copy of the state (a future)
        # Async saves not yet committed, oldest first. Two at most once a write has finished: a
        # save stages into one stager while the previous one still writes from the other
        # (ByteCheckpoint's ping-pong). One before that: DCP starts its writer process in the first.
        self._in_flight: deque[SaveInFlight] = deque()
        self._one_write_done = False
        self._pruning = None  # what a sync save left to the commit thread
        self._stagers = []  # made when first needed, then reused: their (pinned) copies are kept
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="titanlite-commit")
        # torch's writer (thread or process) saves through the default group, and warns on every
        # save of a lone process that has none: give a lone process a group of one.
        self._own_world = mode != "sync" and not self.distributed
        if self._own_world:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        # The background write's own group: its collectives never interleave with training's.
        self._pg = dist.new_group(backend="gloo") if mode != "sync" and self.distributed else None

    def save(self, state, step: int, before_commit=None) -> SaveTiming:
        """Save `state` (dict or Stateful) as `step`; a rank runs `before_commit()` once its data is out."""
        start = time.perf_counter()
        final = step_dir(self.folder, step)
        tmp = final.with_suffix(".partial")
        with writing(tmp, "a checkpoint"):  # a full disk: one line; the last commit stays whole
            self.wait_for_staging()
            # Async saves in flight: at most two (one until a first write is done), and never one
            # of this step or a later one: let them finish rather than write over them.
            while self._in_flight and (
                len(self._in_flight) >= (2 if self._one_write_done else 1)
                or self._in_flight[-1].step >= step
            ):
                self._wait_oldest()
            if self.rank == 0:
                self.folder.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
            if self.distributed:
                dist.barrier()
            sd = state.state_dict() if hasattr(state, "state_dict") else state
            self._described = state.describe() if hasattr(state, "describe") else self.describe
            writer = (RawWriter if self.file_format == "raw" else DcpWriter)(tmp, sync_files=True)
            writer.background = self.mode != "sync"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DCP's notes on planners and deprecated names
                if self.mode == "sync":
                    dcp.save(
                        sd,
                        storage_writer=writer,
                        planner=BalancedSavePlanner(),
                        no_dist=self.world == 1,
                    )
                else:
                    self._async_save(sd, writer, step)
            if before_commit is not None:
                before_commit()
            if self.mode == "sync":
                self._commit(tmp, final, step)
                if self.distributed:
                    dist.barrier()  # everyone returns with the checkpoint committed
            else:
                self._in_flight[-1].commit = self._pool.submit(
                    self._finish, self._in_flight[-1].write, tmp, final, step
                )
        return SaveTiming(step, time.perf_counter() - start, self.mode)

    def _async_save(self, sd: dict, writer, step: int):
        """Start DCP's async save of `sd`: the copy in the background, the write after it."""
        process = self.mode == "async_process"
        options = staging_options(tensor_device_types(sd))
        if options["use_staging_stream"]:
            # The stager copies on its own stream, which does not wait for training's: without
            # this, a save off a logged step could copy weights the optimizer is still writing.
            torch.cuda.current_stream().synchronize()
        stager = self._free_stager(options, process)
        gated = WriteAfter(stager, self._in_flight[-1].write if self._in_flight else None)
        response = dcp.async_save(
            sd,
            storage_writer=writer,
            planner=BalancedSavePlanner(),
            process_group=self._pg,
            async_checkpointer_type=(
                AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
            ),
            async_stager=gated,
        )
        self._staging = gated.copy  # training waits for its copy, not for the previous write
        self._in_flight.append(SaveInFlight(step, stager, response.upload_completion))

    def wait_for_staging(self) -> float:
        """Async: block until the state has been copied out (call before weights change)."""
        if self._staging is None:
            return 0.0
        start = time.perf_counter()
        self._staging.result()
        self._staging = None
        return time.perf_counter() - start

    def wait(self) -> float:
        """Block until the save in flight (if any) is written and committed, and older ones pruned."""
        start = time.perf_counter()
        self.wait_for_staging()
        while self._in_flight:
            self._wait_oldest()
        if self._pruning is not None:
            pruning, self._pruning = self._pruning, None
            pruning.result()
        return time.perf_counter() - start

    def _wait_oldest(self) -> None:
        """Until the oldest save in flight is committed; its failure (a full disk) is raised here."""
        oldest = self._in_flight.popleft()
        with writing(step_dir(self.folder, oldest.step), "a checkpoint"):
            (oldest.commit or oldest.write).result()  # no commit: before_commit raised

    def _free_stager(self, options: dict, shared_memory: bool):
        """A stager no unfinished write reads from: a second is made only while the first writes."""
        busy = [save.stager for save in self._in_flight if not save.write.done()]
        free = [stager for stager in self._stagers if stager not in busy]
        if free:
            return free[0]
        self._stagers.append(make_stager(options, shared_memory=shared_memory))
        return self._stagers[-1]

    def _finish(self, write: Future, tmp: Path, final: Path, step: int) -> None:
        write.result()  # every rank's data is written, rank 0's .metadata too
        self._one_write_done = True
        self._commit(tmp, final, step)

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        """Rank 0: record every file's size and CRC, then rename: the checkpoint exists."""
        # A group torn down under a save still in flight (a peer died and this rank is exiting):
        # DCP then quietly saves this rank's shards alone, a checkpoint that resumes wrong. Seen
        # on a loaded CI machine: never commit it.
        if self.rank != 0 or (self.distributed and not dist.is_initialized()):
            return
        commit(tmp, final, {"step": step, **self._described})
        if self.mode == "sync":  # prune behind training, on the commit thread
            self._pruning = self._pool.submit(self._prune, step)
        else:  # already on the commit thread: a failure fails this save's commit, in one line
            self._prune(step)

    def _prune(self, newest: int) -> None:
        for old in committed(self.folder)[: -self.keep] if self.keep else []:
            gone = old.with_name(old.name + ".deleting")  # never a half-deleted "committed" one
            old.rename(gone)
            shutil.rmtree(gone, ignore_errors=True)
        for stale in self.folder.glob("step-*.partial"):
            if int(stale.name[5:13]) < newest:
                shutil.rmtree(stale, ignore_errors=True)

    def latest(self) -> Path | None:
        return (committed(self.folder) or [None])[-1]

    def load(self, state, path: str | Path | None = None, crc: bool = True, reader=None) -> int:
        """Fill `state` from checkpoint `path` (default: the newest), resharded; returns its step.
        reader: a DCP storage reader for `path` (e.g. one that counts bytes: tools/measure/checkpoint_io.py)."""
        path = Path(path) if path is not None else self.latest()
        if path is None:
            raise TitanliteError(f"no committed checkpoint in '{self.folder}' to load")
        box = [None]  # rank 0 verifies the files and tells everyone (N readers: N times the I/O)
        if self.rank == 0:
            try:
                box[0] = verify(path, crc=crc)
            except TitanliteError as e:
                box[0] = e
        if self.distributed:
            dist.broadcast_object_list(box, src=0)
        if isinstance(info := box[0], TitanliteError):
            raise info
        saved = info.get("model_args")
        here = (state.describe() if hasattr(state, "describe") else self.describe).get("model_args")
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
            self._pool.shutdown(wait=True)
            while self._stagers:
                self._stagers.pop().close()  # its copy thread and staging buffers
            if self.mode == "async_process":
                stop_dcp_writer_process()  # torch has no public way to stop its writer process
            if self._pg is not None:
                dist.destroy_process_group(self._pg)
                self._pg = None
            if self._own_world:
                dist.destroy_process_group()
                self._own_world = False
