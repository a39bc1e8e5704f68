"""Async saves: the copy of the state out of the trainer's memory, then DCP's write of it, both
behind training, on a thread (checkpoint.mode "async") or in a process ("async_process").

    saves = AsyncSaves(process=False, distributed=True)
    saves.make_room(step)                     # the previous copy done; room for one more write
    save = saves.start(state_dict, writer, step, commit_thread)   # returns once the copy began
    saves.wait_for_staging()                  # before the weights change: the copy is done
    saves.wait(folder)                        # every save written and committed

At most two saves are in flight once a first write has finished (ByteCheckpoint's ping-pong: a save
stages into one stager while the previous one still writes from the other); one before that, since
DCP starts its writer process in the first. Stagers are kept: each later save refills their (pinned)
buffers in place. Each write waits for the one before it (`WriteAfter`) on a gloo group of its own,
so no collective of theirs interleaves with training's, or with each other's."""

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from .._compat.torch_internals import stop_dcp_writer_process
from ..errors import writing
from .balanced_io import BalancedSavePlanner
from .checkpoint_files import step_dir
from .staging import WriteAfter, make_stager, staging_options, tensor_device_types


@dataclass
class SaveInFlight:
    """An async save not yet committed: its staging copy, DCP's write of it, the commit after it."""

    step: int
    stager: object  # the buffers the copy went to, busy until the write is done
    write: Future  # every rank's bytes are on disk (DCP's upload_completion)
    commit: Future | None = None  # rank 0 recorded and renamed it; None if before_commit raised


class AsyncSaves:
    """The saves an async Checkpointer has in flight, and what they write with: stagers, the
    background group, DCP's writer thread or process."""

    def __init__(self, process: bool, distributed: bool):
        self.process = process  # DCP's writer in a process of its own (async_process)
        self.copy: Future | None = None  # the newest save's copy out of the trainer's memory
        self.in_flight: deque[SaveInFlight] = deque()  # not yet committed, oldest first
        self.one_write_done = False  # set by the commit thread once a write has finished
        self.stagers = []  # made when first needed, then reused
        # torch's writer saves through the default group, and warns on every save of a lone
        # process that has none: give a lone process a group of one.
        self.own_world = not distributed
        if self.own_world:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        # The writes' own group: their collectives never interleave with training's.
        self.group = dist.new_group(backend="gloo") if distributed else None

    def make_room(self, step: int, folder: Path) -> None:
        """Until a save of `step` may start: the previous copy done, fewer than two saves in
        flight (one until a first write is done), and none of this step or a later one (let it
        finish rather than write over it)."""
        self.wait_for_staging()
        while self.in_flight and (
            len(self.in_flight) >= (2 if self.one_write_done else 1)
            or self.in_flight[-1].step >= step
        ):
            self.wait_oldest(folder)

    def start(self, sd: dict, writer, step: int) -> SaveInFlight:
        """DCP's async save of `sd`: the copy begins now, the write once the copy and the previous
        write are done. The caller hands the returned save its commit."""
        options = staging_options(tensor_device_types(sd))
        if options["use_staging_stream"]:
            # The stager copies on its own stream, which does not wait for training's: without
            # this, a save off a logged step could copy weights the optimizer is still writing.
            torch.cuda.current_stream().synchronize()
        stager = self.free_stager(options)
        gated = WriteAfter(stager, self.in_flight[-1].write if self.in_flight else None)
        response = dcp.async_save(
            sd,
            storage_writer=writer,
            planner=BalancedSavePlanner(),
            process_group=self.group,
            async_checkpointer_type=(
                AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
            ),
            async_stager=gated,
        )
        self.copy = gated.copy  # training waits for its copy, not for the previous write
        self.in_flight.append(SaveInFlight(step, stager, response.upload_completion))
        return self.in_flight[-1]

    def free_stager(self, options: dict):
        """A stager no unfinished write reads from: a second is made only while the first writes."""
        busy = [save.stager for save in self.in_flight if not save.write.done()]
        free = [stager for stager in self.stagers if stager not in busy]
        if free:
            return free[0]
        self.stagers.append(make_stager(options, shared_memory=self.process))
        return self.stagers[-1]

    def wait_for_staging(self) -> float:
        """Block until the newest save's copy is done (call before the weights change); returns
        the seconds it waited."""
        if self.copy is None:
            return 0.0
        start = time.perf_counter()
        self.copy.result()
        self.copy = None
        return time.perf_counter() - start

    def wait_oldest(self, folder: Path) -> None:
        """Until the oldest save in flight is committed; its failure (a full disk) is raised here."""
        oldest = self.in_flight.popleft()
        with writing(step_dir(folder, oldest.step), "a checkpoint"):
            (oldest.commit or oldest.write).result()  # no commit: before_commit raised

    def wait(self, folder: Path) -> None:
        """Until every save in flight is written and committed."""
        self.wait_for_staging()
        while self.in_flight:
            self.wait_oldest(folder)

    def close(self) -> None:
        """Stop the stagers' threads and buffers, DCP's writer process, the groups made here."""
        while self.stagers:
            self.stagers.pop().close()
        if self.process:
            stop_dcp_writer_process()  # torch has no public way to stop its writer process
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        if self.own_world:
            dist.destroy_process_group()
            self.own_world = False
