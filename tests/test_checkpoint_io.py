"""Where a checkpoint's bytes go (issue 24): a save spreads them evenly over the ranks (DCP's
dedup plan), and a load under data parallelism reads each replicated byte once in the job
(resilience/balanced_io.py) instead of once per rank, into the same state. Byte counts, not timings."""

from __future__ import annotations

import sys
import time

import pytest
from conftest import tiny_overrides

from titanlite.config import load_config
from titanlite.tools.jobs.launcher import launch, launch_function
from titanlite.tools.measure.checkpoint_io import balance, bytes_written_per_rank, data_bytes

LAYOUTS = {
    "ddp2": (2, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}),
    "ddp4": (4, {"parallel.dp_replicate": 4, "parallel.dp_shard": 1}),
    "hsdp2x2": (4, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}),
}


def test_bytes_per_rank_come_from_dcps_file_names(tmp_path):
    for name, size in {
        "__0_0.distcp": 300,
        "__0_1.distcp": 20,
        "__1_0.distcp": 310,
        ".metadata": 999,
        "titanlite.json": 50,
    }.items():
        (tmp_path / name).write_bytes(b"x" * size)
    assert bytes_written_per_rank(tmp_path) == {0: 320, 1: 310} and data_bytes(tmp_path) == 630
    assert balance({0: 320, 1: 310}) == pytest.approx(320 / 315)


def _saved_run(data_dir, tmp_path, nproc, layout):
    o = tiny_overrides(
        data_dir,
        tmp_path,
        **{"training.steps": 1, "eval.every": 0, "checkpoint.enable": True, **layout},
    )
    result = launch(load_config(None, o), nproc, timeout_s=600)
    (step,) = sorted((result.run_dir / "checkpoints").glob("step-????????"))
    return o, step


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_save_spreads_its_bytes_evenly_over_the_ranks(data_dir, tmp_path, layout):
    nproc, overrides = LAYOUTS[layout]
    _, step = _saved_run(data_dir, tmp_path, nproc, overrides)
    per_rank = bytes_written_per_rank(step)
    assert sorted(per_rank) == list(range(nproc)) and balance(per_rank) <= 1.1, per_rank


@pytest.mark.slow
def test_read_once_loading_reads_each_replicated_byte_once_into_the_same_state(data_dir, tmp_path):
    o, step = _saved_run(data_dir, tmp_path, 2, LAYOUTS["ddp2"][1])
    size = data_bytes(step)
    runs = {}
    for read_once in (False, True):
        runs[read_once] = launch_function(
            "titanlite.tools.measure.checkpoint_io:load_bytes",
            nproc=2,
            log_dir=str(tmp_path / f"load-{read_once}"),
            timeout_s=600,
            overrides=o,
            step_dir=str(step),
            read_once=read_once,
        )
    every_rank = sum(r["bytes_read"] for r in runs[False])
    once = sum(r["bytes_read"] for r in runs[True])
    assert every_rank >= 1.9 * size  # DCP's default: each rank reads it all
    assert once <= 1.05 * size and max(r["bytes_read"] for r in runs[True]) <= 0.6 * size
    digests = {r["digest"] for rs in runs.values() for r in rs}
    assert len(digests) == 1 and all(r["step"] == 1 for rs in runs.values() for r in rs)


@pytest.mark.parametrize("mode", ["sync", "async", "async_process"])
def test_the_commit_takes_each_files_crc_from_the_bytes_written(tmp_path, monkeypatch, mode):
    """No data file is read back to commit (the writer counted its CRC-32 as it wrote), and every
    recorded CRC is the file's true one: the load-time check is exactly as strong as before."""
    import json

    import torch

    from titanlite.resilience import checkpoint_files
    from titanlite.resilience.checkpoint import Checkpointer
    from titanlite.resilience.checkpoint_files import verify

    read_back, real = [], checkpoint_files.crc32
    monkeypatch.setattr(checkpoint_files, "crc32", lambda f: read_back.append(f.name) or real(f))
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(300, 100), "b": torch.randn(7)}, "step": 1}
    ckpt = Checkpointer(tmp_path, mode=mode, file_format="raw")
    ckpt.save(state, 1)
    ckpt.close()
    step = tmp_path / "step-00000001"
    files = json.loads((step / "titanlite.json").read_text())["files"]
    data = [name for name in files if name.endswith(".distcp")]
    assert data and not [name for name in read_back if name.endswith(".distcp")], read_back
    assert all(files[name] == [(step / name).stat().st_size, real(step / name)] for name in files)
    assert not list(step.glob("*.crc"))  # the writer's notes are gone once recorded
    monkeypatch.setattr(checkpoint_files, "crc32", real)
    assert verify(step)["step"] == 1


def test_a_reused_stager_allocates_staging_memory_only_for_the_first_save(tmp_path):
    import torch

    from titanlite.tools.measure.checkpoint_io import staging_reuse

    state = {"model": {"w": torch.randn(200, 50), "b": torch.randn(5)}, "step": 1}
    first, *later = staging_reuse(state, tmp_path / "ck", saves=3)
    assert first >= 2 and later == [0, 0]


def test_dcps_save_order_can_pile_bytes_on_one_rank_and_the_balanced_planner_does_not():
    """Planned in this process for 2 DDP ranks holding the same lumpy state: two big tensors and many
    small ones, as a debug-size model has."""
    import torch
    from torch.distributed.checkpoint import DefaultSavePlanner

    from titanlite.resilience.balanced_io import BalancedSavePlanner
    from titanlite.tools.measure.checkpoint_io import planned_bytes_per_rank

    sd = {
        "model": {
            "small.0": torch.zeros(1000),
            "embed": torch.zeros(512, 64),
            **{f"small.{i}": torch.zeros(900) for i in range(1, 12)},
            "out": torch.zeros(512, 64),
        }
    }
    dcp_order = planned_bytes_per_rank(sd, 2, DefaultSavePlanner)
    balanced = planned_bytes_per_rank(sd, 2, BalancedSavePlanner)
    assert sum(dcp_order) == sum(balanced)
    assert balance(dict(enumerate(dcp_order))) > 1.1 and balance(dict(enumerate(balanced))) <= 1.02


def test_a_save_stages_into_a_second_kept_buffer_while_the_previous_one_still_writes(
    tmp_path, monkeypatch
):
    """ByteCheckpoint's ping-pong pool. Save 1 is written whole (until one write has finished DCP may
    still be starting its writer process: saves do not overlap yet). Save 2's write is held up; save 3
    stages at once into a second stager (training does not wait for save 2's write), its write starts
    only after save 2's (never two at once on the background group), commits come in order, each
    checkpoint holds its own step's values, and save 4 reuses one of the two stagers."""
    import threading
    import time
    from pathlib import Path

    import torch

    from titanlite.resilience import async_saves
    from titanlite.resilience.checkpoint import Checkpointer

    made, make_stager = [], async_saves.make_stager
    monkeypatch.setattr(
        async_saves, "make_stager", lambda *a, **kw: made.append(make_stager(*a, **kw)) or made[-1]
    )
    release, started, running, most = threading.Event(), [], [0], [0]
    from titanlite.resilience.checkpoint_files import RawWriter

    write_data = RawWriter.write_data

    def held_write(self, plan, planner):
        name = Path(self.path).name
        started.append(name)
        running[0] += 1
        most[0] = max(most[0], running[0])
        try:
            if name == "step-00000002.partial":
                assert release.wait(20), "save 3 waited for save 2's write"
            return write_data(self, plan, planner)
        finally:
            running[0] -= 1

    monkeypatch.setattr(RawWriter, "write_data", held_write)

    folder = tmp_path / "ck"
    ckpt = Checkpointer(folder, mode="async", keep_latest_k=0, file_format="raw")
    state = {"w": torch.zeros(4096)}

    def save(step):
        state["w"].fill_(step)
        ckpt.save(state, step)
        ckpt.wait_for_staging()
        state["w"].fill_(-1)  # the next optimizer step

    try:
        save(1)
        # save 1 has committed before save 2 began: no overlap before a first finished write
        save(2)
        assert len(made) == 1 and (folder / "step-00000001").is_dir()
        save(3)
        # Save 2 is still held: save 3 was staged (copied) into a buffer of its own, and waits to write.
        deadline = time.monotonic() + 20
        while "step-00000002.partial" not in started and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # time enough for save 3's write to start, were it not held back
        assert len(made) == 2 and started[1:] == ["step-00000002.partial"]
        assert not (folder / "step-00000002").exists() and not (folder / "step-00000003").exists()
        release.set()
        save(4)
    finally:
        release.set()
        ckpt.close()
    assert len(made) == 2, "save 4 reused a kept stager"
    assert started == [f"step-0000000{s}.partial" for s in (1, 2, 3, 4)] and most[0] == 1
    for step in (1, 2, 3, 4):
        loaded = {"w": torch.empty(4096)}
        assert ckpt.load(loaded, folder / f"step-{step:08d}") == step
        assert torch.equal(loaded["w"], torch.full((4096,), float(step))), step


def test_a_save_of_a_step_in_flight_waits_for_it_instead_of_writing_over_it(tmp_path):
    """Saving step N again (or an earlier step) while step N still writes would delete its `.partial`
    folder under the writer: the second save waits for the first to commit, then replaces it."""
    import torch

    from titanlite.resilience.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path / "ck", mode="async", keep_latest_k=0)
    state = {"w": torch.zeros(1 << 16)}
    try:
        for value, step in ((1.0, 1), (2.0, 2), (3.0, 2), (4.0, 1)):
            state["w"].fill_(value)
            ckpt.save(state, step)
            ckpt.wait_for_staging()
    finally:
        ckpt.close()
    for step, value in ((1, 4.0), (2, 3.0)):
        loaded = {"w": torch.empty(1 << 16)}
        assert ckpt.load(loaded, tmp_path / "ck" / f"step-{step:08d}") == step
        assert torch.equal(loaded["w"], torch.full((1 << 16,), value)), step


def test_a_save_whose_group_is_torn_down_before_it_writes_is_never_committed(tmp_path, monkeypatch):
    """Seen on a loaded CI machine: rank 1 was killed during the async save of step 6; rank 0's
    next collective failed, it left the process group, and only then did its background write of
    step 6 begin. DCP, finding no group, quietly saved rank 0's shards alone - and that was
    committed, so the restart resumed from half a checkpoint. Replayed here in one process: the
    write is held until the group is gone; it must not become a checkpoint."""
    import threading

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import _async_thread_executor

    from titanlite.resilience.checkpoint import Checkpointer
    from titanlite.resilience.checkpoint_files import committed

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ckpt = Checkpointer(tmp_path / "ck", mode="async", keep_latest_k=0)
    try:
        state = {"w": torch.ones(1 << 10)}
        ckpt.save(state, 1)
        ckpt.wait()  # a save in a live group commits
        assert [p.name for p in committed(tmp_path / "ck")] == ["step-00000001"]
        go, original = threading.Event(), _async_thread_executor.save_wrapper

        def held(*args, **kwargs):
            go.wait(30)
            return original(*args, **kwargs)

        monkeypatch.setattr(_async_thread_executor, "save_wrapper", held)
        ckpt.save(state, 2)
        ckpt.wait_for_staging()
        dist.destroy_process_group()  # as a failing rank leaves: its peer is gone
        ckpt.behind.group = None  # destroyed with the rest
        go.set()
        ckpt.wait()
        assert [p.name for p in committed(tmp_path / "ck")] == ["step-00000001"]
    finally:
        ckpt.behind.group = None
        ckpt.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _every_kind_of_entry():
    import torch

    torch.manual_seed(0)
    big = torch.randn(10, 12)
    return {
        "model": {
            "w": torch.randn(64, 48),
            "bf16": torch.randn(9, 5).bfloat16(),
            "t": torch.randn(6, 4).t(),
            "narrow": big[2:5],
            "empty": torch.empty(0, 3),
        },
        "optimizer": {
            "step": torch.tensor(3.0),
            "ids": torch.arange(11),
            "mask": torch.rand(13) > 0.5,
            "lr": 0.25,
            "groups": [{"betas": (0.9, 0.95)}],
        },
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tensors_are_stored_as_their_bytes_and_load_back_exactly(tmp_path, mode):
    """Every kind of entry a training state holds round-trips; a tensor's bytes in the file are the
    tensor's own (no torch.save container around them), marked so that no reader mistakes them."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from titanlite.resilience.checkpoint import Checkpointer
    from titanlite.resilience.checkpoint_files import RAW

    state = _every_kind_of_entry()
    ckpt = Checkpointer(tmp_path, mode=mode, file_format="raw")
    ckpt.save(state, 1)
    ckpt.close()
    step = tmp_path / "step-00000001"
    meta = FileSystemReader(step).read_metadata()
    data = (step / "__0_0.distcp").read_bytes()
    flat = {
        "model.w": state["model"]["w"],
        "model.bf16": state["model"]["bf16"],
        "model.t": state["model"]["t"],
        "model.narrow": state["model"]["narrow"],
        "optimizer.ids": state["optimizer"]["ids"],
    }
    for name, tensor in flat.items():
        ((index, info),) = [(i, s) for i, s in meta.storage_data.items() if i.fqn == name]
        assert list(info.transform_descriptors) == [RAW]
        want = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert data[info.offset : info.offset + info.length] == want, name
    fresh = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optimizer": {
            "step": torch.tensor(0.0),
            "ids": torch.zeros(11, dtype=torch.int64),
            "mask": torch.zeros(13, dtype=torch.bool),
            "lr": None,
            "groups": [{"betas": None}],
        },
    }
    loader = Checkpointer(tmp_path)
    assert loader.load(fresh) == 1
    loader.close()
    for part in ("model", "optimizer"):
        for key, value in state[part].items():
            got = fresh[part][key]
            assert (
                (torch.equal(got, value) and got.dtype == value.dtype)
                if isinstance(value, torch.Tensor)
                else got == value
            ), key


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_default_format_is_torchs_own_and_torch_alone_reads_it(tmp_path, mode):
    """A checkpoint in the default format opens with nothing but torch: `dcp.load` with torch's
    own reader into a plain state dict (a torchtitan user's way), in a process that never
    imported titanlite, and `dcp_to_torch_save`; every kind of entry comes back equal. The
    commit, which did not see the bytes go out, read each file back for its CRC."""
    import json
    import subprocess

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from titanlite.resilience.checkpoint import Checkpointer
    from titanlite.resilience.checkpoint_files import crc32, verify

    state = _every_kind_of_entry()
    ckpt = Checkpointer(tmp_path, mode=mode)
    ckpt.save(state, 1)
    ckpt.close()
    step = tmp_path / "step-00000001"
    files = json.loads((step / "titanlite.json").read_text())["files"]
    assert all(files[n] == [(step / n).stat().st_size, crc32(step / n)] for n in files)
    assert verify(step)["step"] == 1
    template = {
        part: {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in d.items()
        }
        for part, d in state.items()
    }
    template["optimizer"]["groups"] = [{"betas": None}]
    torch.save(template, tmp_path / "template.pt")
    script = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        f"sd = torch.load({str(tmp_path / 'template.pt')!r}, weights_only=False)\n"
        f"dcp.load(sd, checkpoint_id={str(step)!r}, no_dist=True)\n"
        f"torch.save(sd, {str(tmp_path / 'loaded.pt')!r})\n"
        "assert not [m for m in sys.modules if m.startswith('titanlite')]\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    dcp_to_torch_save(step, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    for got in (loaded, whole):
        for part in ("model", "optimizer"):
            for key, value in state[part].items():
                have = got[part][key]
                same = (
                    torch.equal(have, value) and have.dtype == value.dtype
                    if isinstance(value, torch.Tensor)
                    else have == value
                )
                assert same, (part, key, have, value)


def test_a_checkpoint_written_by_dcps_own_writer_still_loads(tmp_path):
    """Checkpoints from before the raw format (DCP's torch.save per tensor) load through the same reader."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from titanlite.resilience.checkpoint_files import dcp_load

    state = _every_kind_of_entry()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    fresh = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optimizer": {
            "step": torch.tensor(0.0),
            "ids": torch.zeros(11, dtype=torch.int64),
            "mask": torch.zeros(13, dtype=torch.bool),
            "lr": None,
            "groups": [{"betas": None}],
        },
    }
    dcp_load(fresh, tmp_path, crc_checked=True, no_dist=True)
    assert all(torch.equal(fresh["model"][k], v) for k, v in state["model"].items())
    assert (
        torch.equal(fresh["optimizer"]["ids"], state["optimizer"]["ids"])
        and fresh["optimizer"]["lr"] == 0.25
    )


def test_dcps_own_reader_refuses_raw_tensors_instead_of_misreading_them(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from titanlite.resilience.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path, file_format="raw")
    ckpt.save({"w": torch.randn(8)}, 1)
    ckpt.close()
    with pytest.raises(
        BaseException, match="titanlite.raw"
    ):  # DCP's CheckpointException is a BaseException
        dcp.load({"w": torch.zeros(8)}, checkpoint_id=tmp_path / "step-00000001", no_dist=True)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread CPU priority is a Linux call"
)
def test_an_async_writer_yields_the_cpu_to_training_and_a_sync_save_does_not(tmp_path, monkeypatch):
    """An async save's writer thread lowers its own priority (nice 19): on a CPU the training step keeps
    the cores. A sync save writes on training's own thread, which must keep its priority."""
    import os
    import threading

    import torch

    from titanlite.resilience.checkpoint import Checkpointer

    calls, set_priority = [], os.setpriority
    monkeypatch.setattr(
        os,
        "setpriority",
        lambda which, who, prio: calls.append((who, prio)) or set_priority(which, who, prio),
    )
    for mode in ("sync", "async"):
        ckpt = Checkpointer(tmp_path / mode, mode=mode)
        ckpt.save({"w": torch.randn(64)}, 1)
        ckpt.close()
        if mode == "sync":
            assert calls == []
    ((who, prio),) = calls
    assert prio == 19 and who != threading.main_thread().native_id


def test_a_save_works_on_a_system_without_fdatasync(tmp_path, monkeypatch):
    """macOS has no os.fdatasync: the writer starts the disk with fsync there (more than 4 MiB: it does)."""
    import os

    import torch

    from titanlite.resilience.checkpoint import Checkpointer

    monkeypatch.delattr(os, "fdatasync", raising=False)
    state = {"w": torch.randn(3 << 20)}  # 12 MiB
    ckpt = Checkpointer(tmp_path, file_format="raw")
    ckpt.save(state, 1)
    fresh = {"w": torch.zeros(3 << 20)}
    assert ckpt.load(fresh) == 1 and torch.equal(fresh["w"], state["w"])
    ckpt.close()


def test_a_disk_error_seen_by_a_background_sync_fails_the_save_and_keeps_the_last_good_one(
    tmp_path, monkeypatch
):
    """Linux reports a write error to one fsync caller only: if the writer's background sync got it, the
    final fsync returns fine. The save must still fail, uncommitted, and the previous checkpoint load."""
    import errno
    import os

    import torch

    from titanlite.resilience.checkpoint import Checkpointer
    from titanlite.resilience.checkpoint_files import committed

    ckpt = Checkpointer(tmp_path, keep_latest_k=1, file_format="raw")
    ckpt.save({"w": torch.ones(3 << 20)}, 1)

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing, raising=False)
    with pytest.raises(
        BaseException, match="Input/output error"
    ):  # DCP's CheckpointException is a BaseException
        ckpt.save({"w": torch.zeros(3 << 20)}, 2)
    monkeypatch.undo()
    assert [p.name for p in committed(tmp_path)] == ["step-00000001"]
    fresh = {"w": torch.zeros(3 << 20)}
    assert ckpt.load(fresh) == 1 and torch.equal(fresh["w"], torch.ones(3 << 20))
    ckpt.close()


def _spin(seconds: float) -> None:
    """Use `seconds` of this process's CPU."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _burn(seconds: float, done) -> None:
    _spin(seconds)
    done.set()
    time.sleep(60)  # still running when measured: only live children are counted


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_seconds_counts_the_trainer_and_its_writer_process():
    """The bench's account of an async save's CPU: this process's, and a child process's (DCP's writer)."""
    import multiprocessing

    from titanlite.labs.nb12_distributed_checkpointing import _cpu_seconds

    before = _cpu_seconds()
    _spin(0.3)
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Event()
    child = ctx.Process(target=_burn, args=(0.4, done), daemon=True)
    child.start()
    try:
        assert done.wait(60)
        after = _cpu_seconds()
    finally:
        child.kill()
        child.join()
    assert after["trainer"] - before["trainer"] >= 0.25
    assert after["writer"] - before["writer"] >= 0.35  # the child's own, not this process's
    # a child that ended is no longer counted
    assert _cpu_seconds()["writer"] - before["writer"] < 0.1
