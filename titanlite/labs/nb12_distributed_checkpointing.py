"""Notebook 12's measurements, shared with bench/checkpoint.py.

    disk_write_bandwidth(folder)           # bytes/s this disk sustains, fsync included
    blocking_times("small", folder)        # seconds training stands still per save, per mode
    anatomy(step_dir)                      # what a DCP checkpoint holds: data files vs metadata
    train_and_save(overrides)              # in every rank: the trainer, checkpoints on
    load_resharded(overrides, step_dir)    # in every rank: another layout loads a checkpoint
    where_the_bytes_go(overrides)          # in every rank: bytes written, and read with and without read-once

train_and_save and load_resharded return the trainer's whole state (sharded tensors gathered to full
ones), so a notebook can compare what one layout saved with what another loaded, tensor by tensor.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from .._compat.torch_internals import stop_dcp_writer_process
from ..errors import TitanliteError
from ..models.llama import ModelArgs
from ..resilience.checkpoint import Checkpointer
from ..resilience.checkpoint_files import committed
from ._common import next_token_loss, random_tokens, seeded_model

SAVE_MODES = ("torch.save", "sync", "async", "async_process")


def disk_write_bandwidth(
    folder: str | Path, nbytes: int = 256 << 20, block: int = 8 << 20
) -> float:
    """Bytes per second for writing `nbytes` of random data to a file in `folder` and fsyncing
    it (random: no file system can compress it away). The file is removed afterwards. As titanlite's
    checkpoint writer does, the disk is set to work on each block as it comes (a background fdatasync),
    so a save is compared with the best this disk does, not with a write that idles it until fsync."""
    if nbytes < block or block <= 0:
        raise TitanliteError(
            f"disk_write_bandwidth needs nbytes >= block > 0, got {nbytes} and {block}"
        )
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / f".bandwidth-{os.getpid()}.bin"
    data = os.urandom(block)
    try:
        start = time.perf_counter()
        with open(path, "wb") as f:
            flushing = None
            for n in [block] * (nbytes // block) + ([nbytes % block] if nbytes % block else []):
                f.write(data[:n])
                if flushing is None or not flushing.is_alive():
                    f.flush()
                    flushing = threading.Thread(
                        target=getattr(os, "fdatasync", os.fsync), args=(f.fileno(),)
                    )
                    flushing.start()
            f.flush()
            os.fsync(f.fileno())  # until the disk has it, not only the page cache
            flushing.join()
        seconds = time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
    return nbytes / seconds


def training_state(preset: str = "small", seed: int = 0):
    """A model of `preset` after one AdamW step (so the moments exist), and its state in the
    shape TrainState saves: {"model": ..., "optimizer": ...} with flat, per-parameter keys."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    args = ModelArgs.preset(preset)
    model = seeded_model(args, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _forward_backward(model, args)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_sd, optim_sd = get_state_dict(
            model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
    return model, {"model": model_sd, "optimizer": optim_sd}


def _forward_backward(model, args: ModelArgs, batch: int = 2, seq: int = 64) -> None:
    tokens = random_tokens(args.vocab_size, (batch, seq + 1), seed=0)
    next_token_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by this process (every thread) and by its child processes that are still
    running (DCP's writer process), read from /proc: Linux only, else {}."""
    import multiprocessing

    def used(pid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # no /proc (macOS), or a child that just ended
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    if (trainer := used(os.getpid())) is None:
        return {}
    children = (used(p.pid) for p in multiprocessing.active_children())
    return {"trainer": trainer, "writer": sum(c for c in children if c is not None)}


def _bytes_in(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _time_torch_save(state: dict, path: Path) -> tuple[float, int]:
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # DCP writes with sync_files=True: the same promise
    seconds = time.perf_counter() - start
    size = path.stat().st_size
    path.unlink()
    return seconds, size


@contextlib.contextmanager
def _stderr_to(path: Path):
    """Point file descriptor 2 at `path`. DCP's checkpoint process, spawned inside, inherits it
    and logs INFO lines there for good, instead of into the notebook's output."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "a") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _time_dcp(
    mode: str,
    state: dict,
    folder: Path,
    repeats: int,
    overlap_with=None,
    disk_beside: bool = False,
    file_format: str = "dcp",
) -> dict:
    """`repeats` saves through a Checkpointer. blocked: the save() call plus wait_for_staging()
    right after it (the most an async save can stall training); done: until committed.
    overlapped (async, with overlap_with): a forward+backward runs between the two, as the
    trainer's next step does, and only what is left of the staging is waited for (residual);
    then forward+backwards run on until the write has committed (write_steps_s: their seconds,
    a list per save), as training goes on beside a background write, and as many again with no save
    in flight (alone_steps_s): the machine's speed a moment later, to compare them with. cpu_beside_s /
    cpu_alone_s: the CPU seconds of the trainer and of the writer process over those two stretches.
    disk_beside (sync): after each save, the disk's bandwidth for as many bytes (disk_bytes_per_s)."""
    ckpt = Checkpointer(folder, mode=mode, keep_latest_k=1, file_format=file_format)
    out = {
        k: []
        for k in (
            "blocked_s",
            "call_s",
            "staging_s",
            "done_s",
            "overlapped_s",
            "residual_s",
            "compute_s",
            "write_steps_s",
            "alone_steps_s",
            "cpu_beside_s",
            "cpu_alone_s",
            "disk_bytes_per_s",
        )
    }
    steps = iter(range(1, 2 * repeats + 1))
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            out["call_s"].append(ckpt.save(state, next(steps)).blocked_s)
            out["staging_s"].append(ckpt.wait_for_staging())
            out["blocked_s"].append(time.perf_counter() - start)
            ckpt.wait()  # async: written, committed and the previous one pruned; sync: only that pruning
            out["done_s"].append(
                out["blocked_s"][-1] if mode == "sync" else time.perf_counter() - start
            )
            if (
                mode == "sync" and disk_beside
            ):  # this disk's speed swings within a run: the same moment
                nbytes = _bytes_in(committed(folder)[-1])
                out["disk_bytes_per_s"].append(
                    disk_write_bandwidth(folder, nbytes, min(nbytes, 8 << 20))
                )
            if mode != "sync" and overlap_with is not None:
                before = _cpu_seconds()
                call = ckpt.save(state, next(steps)).blocked_s
                out["compute_s"].append(_seconds(overlap_with))
                out["residual_s"].append(ckpt.wait_for_staging())
                out["overlapped_s"].append(call + out["residual_s"][-1])
                waiter = threading.Thread(target=ckpt.wait)
                waiter.start()
                beside = []
                while waiter.is_alive():
                    beside.append(_seconds(overlap_with))
                waiter.join()
                out["write_steps_s"].append(beside)
                middle = _cpu_seconds()
                out["alone_steps_s"].append(
                    [_seconds(overlap_with) for _ in range(1 + len(beside))]
                )
                after = _cpu_seconds()
                out["cpu_beside_s"].append(
                    {k: middle[k] - before[k] for k in before.keys() & middle.keys()}
                )
                out["cpu_alone_s"].append(
                    {k: after[k] - middle[k] for k in middle.keys() & after.keys()}
                )
        out["bytes"] = _bytes_in(committed(folder)[-1])
    finally:
        ckpt.close()
    return {k: v for k, v in out.items() if v != []}


def blocking_times(
    preset: str = "small",
    folder: str | Path = "runs/ckpt-bench",
    modes=SAVE_MODES,
    repeats: int = 3,
    overlap: bool = True,
    keep: bool = False,
    disk_beside: bool = False,
    file_format: str = "dcp",
    host_idle: bool = False,
) -> dict:
    """How long each way of saving stops training, on a `preset` model with its AdamW state, the
    DCP modes in `file_format` (dcp: torch's own; raw: each tensor's bare bytes). `host_idle`: the
    training step beside an async save is a wait as long as the real one, during which the host
    does nothing, as a GPU's step is for the host; otherwise it is the real step, on the CPU.

    Returns {"preset", "params", "state_bytes", "compute_alone_s", "modes": {mode: {"bytes",
    "blocked_s", "done_s" (one per repeat), "first_s", "steady_s", "done_steady_s" (medians
    after the first), and for async modes "staging_s", "overlapped_s", "residual_s",
    "compute_s", "write_steps_s", "alone_steps_s", "cpu_beside_s", "cpu_alone_s"}, and with
    disk_beside for "sync" "disk_bytes_per_s"}}. The first async_process save spawns the writer process (in `done_s[0]`)."""
    unknown = [m for m in modes if m not in SAVE_MODES]
    if unknown or repeats < 1:
        raise TitanliteError(
            f"blocking_times: modes must be among {SAVE_MODES} (got {unknown}) and "
            f"repeats >= 1 (got {repeats})"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model, state = training_state(preset)
    storages = {
        v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()  # tied weights once
        for part in state.values()
        for v in part.values()
        if torch.is_tensor(v)
    }
    result = {
        "preset": preset,
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": sum(storages.values()),
        "modes": {},
    }
    # Async saves write on a gloo group of their own, and the process mode's worker joins one:
    # a plain process gets a world of one for the measurement (ended below).
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    args = ModelArgs.preset(preset)
    step = (lambda: _forward_backward(model, args)) if overlap else None
    if overlap:  # the step alone (after a warm-up), to see how much a copy beside it slows it
        step()
        result["compute_alone_s"] = statistics.median(_seconds(step) for _ in range(3))
        if host_idle:  # the host waits while "the GPU" computes: nothing for a save to slow down
            seconds = result["compute_alone_s"]
            step = lambda: time.sleep(seconds)  # noqa: E731
            result["host_idle"] = True
    try:
        for mode in modes:
            if mode == "torch.save":
                target = folder / f"state.rank{dist.get_rank()}.pt"
                runs = [_time_torch_save(state, target) for _ in range(repeats)]
                r = {
                    "blocked_s": [s for s, _ in runs],
                    "done_s": [s for s, _ in runs],
                    "bytes": runs[0][1],
                }
            elif mode == "async_process":
                with _stderr_to(folder / "checkpoint-process.log"):
                    r = _time_dcp(mode, state, folder / mode, repeats, step, False, file_format)
            else:
                r = _time_dcp(mode, state, folder / mode, repeats, step, disk_beside, file_format)
            r["first_s"] = r["blocked_s"][0]
            r["steady_s"] = statistics.median(r["blocked_s"][1:] or r["blocked_s"])
            r["done_steady_s"] = statistics.median(r["done_s"][1:] or r["done_s"])
            result["modes"][mode] = r
            if not keep:
                shutil.rmtree(folder / mode, ignore_errors=True)
                (folder / "checkpoint-process.log").unlink(missing_ok=True)
    finally:
        if "async_process" in modes:
            stop_dcp_writer_process()
        if own_group:
            dist.destroy_process_group()
    return result


def formats_side_by_side(state: dict, folder: str | Path, repeats: int = 3) -> dict:
    """The same state saved (sync, in this process) in each checkpoint format: {format: {"cpu_s",
    "wall_s" (medians per save), "bytes", "step_dir", "loads_back" (titanlite's reader, exact),
    "torch_alone" (None if torch's own dcp.load reads it, else the first line of its refusal)}}."""
    import torch.distributed.checkpoint as dcp

    from ..resilience.checkpoint import FORMATS

    out = {}
    for file_format in FORMATS:
        ckpt = Checkpointer(Path(folder) / file_format, keep_latest_k=1, file_format=file_format)
        cpu, wall = [], []
        for step in range(1, repeats + 1):
            start_cpu, start = time.process_time(), time.perf_counter()
            ckpt.save(state, step)
            cpu.append(time.process_time() - start_cpu)
            wall.append(time.perf_counter() - start)
        ckpt.wait()
        step_dir = committed(ckpt.folder)[-1]
        fresh = _zeros_like(state)
        ckpt.load(fresh, step_dir)
        ckpt.close()
        refusal = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                dcp.load(_zeros_like(state), checkpoint_id=step_dir, no_dist=True)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                refusal = next((ln for ln in str(e).splitlines() if "titanlite.raw" in ln), str(e))
        out[file_format] = {
            "cpu_s": statistics.median(cpu),
            "wall_s": statistics.median(wall),
            "bytes": _bytes_in(step_dir),
            "step_dir": str(step_dir),
            "loads_back": _equal(fresh, state),
            "torch_alone": refusal and refusal.strip()[:200],
        }
    return out


def _zeros_like(tree):
    if torch.is_tensor(tree):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    return tree


def _equal(a, b) -> bool:
    if torch.is_tensor(b):
        return torch.is_tensor(a) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in b)
    return a == b


def anatomy(checkpoint: str | Path) -> dict:
    """The files of a DCP checkpoint with their sizes, and its `.metadata` index: for every
    entry the global shape, and for tensors every chunk (offsets, sizes) with the file and
    byte range that hold it. Sharded tensors show one chunk per rank that owned a piece."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(checkpoint)
    files = {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()}
    meta = FileSystemReader(str(path)).read_metadata()
    where = {(i.fqn, tuple(i.offset or ())): s for i, s in meta.storage_data.items()}
    entries = {}
    for key, m in meta.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            chunks = []
            for c in m.chunks:
                s = where.get((key, tuple(c.offsets)))
                chunks.append(
                    {
                        "offsets": list(c.offsets),
                        "sizes": list(c.sizes),
                        "file": s.relative_path if s else None,
                        "byte_offset": s.offset if s else None,
                        "length": s.length if s else None,
                    }
                )
            entries[key] = {
                "kind": "tensor",
                "shape": list(m.size),
                "dtype": str(m.properties.dtype),
                "chunks": chunks,
            }
        else:  # pickled Python values: step counters, the schedule, RNG states
            s = where.get((key, ()))
            entries[key] = {
                "kind": "bytes",
                "file": s.relative_path if s else None,
                "byte_offset": s.offset if s else None,
                "length": s.length if s else None,
            }
    return {
        "path": str(path),
        "files": files,
        "data_bytes": sum(v for k, v in files.items() if k.endswith(".distcp")),
        "metadata_bytes": files.get(".metadata", 0),
        "entries": entries,
    }


# ----- in every rank of a launch_function job (or a plain process: a world of one) ---------


def full_train_state(trainer) -> dict:
    """TrainState's model and optimizer entries as whole CPU tensors (every rank must call
    it: DTensor shards are gathered), plus the step."""
    from torch.distributed.tensor import DTensor

    state = trainer.train_state().state_dict()

    def whole(v):
        if isinstance(v, DTensor):
            v = v.full_tensor()
        return v.detach().cpu().clone() if torch.is_tensor(v) else v

    return {
        "model": {k: whole(v) for k, v in state["model"].items()},
        "optimizer": {k: whole(v) for k, v in state["optimizer"].items()},
        "step": state["step"],
    }


def _layout(trainer, key: str = "layers.0.attention.o_proj.weight") -> dict:
    """How this rank holds one weight: its local shape and placements (the layout, shown)."""
    p = dict(trainer.model.named_parameters())[key]
    local = p.to_local() if hasattr(p, "to_local") else p
    return {
        "layout": trainer.dims.describe(),
        "rank": trainer.dist.rank,
        "key": key,
        "shape": list(p.shape),
        "local_shape": list(local.shape),
        "placements": [str(x) for x in getattr(p, "placements", ())],
    }


def _trainer(overrides: dict):
    from ..config import load_config
    from ..train import Trainer

    o = dict(overrides)
    job = os.environ.get("TITANLITE_JOB_DIR")
    if job:  # log where launch_function tails, so the notebook's live plot sees the steps
        o.update({"metrics.log_dir": str(Path(job).parent), "metrics.run_name": Path(job).name})
    return Trainer(load_config(None, o))


def train_and_save(overrides: dict) -> dict:
    """Train with [checkpoint] on (set checkpoint.folder in `overrides`); return the state of
    the last save, whole, on rank 0, and every rank's layout."""
    trainer = _trainer({**overrides, "checkpoint.enable": True})
    history = trainer.fit()
    state = full_train_state(trainer)  # fit() ends with the last save committed
    return {
        **_layout(trainer),
        "state": state if trainer.dist.is_main else None,
        "checkpoints": history.checkpoints,
        "committed": [p.name for p in committed(trainer.cfg.checkpoint.folder)],
    }


def load_resharded(overrides: dict, checkpoint: str | Path) -> dict:
    """Build a Trainer in the layout `overrides` asks for, load `checkpoint` into it (each rank
    reads the pieces its shards need), and return the loaded state, whole, on rank 0."""
    trainer = _trainer({**overrides, "checkpoint.enable": False})
    ckpt = Checkpointer(Path(checkpoint).parent)  # TrainState describes the model it checks
    try:
        start = time.perf_counter()
        step = trainer.step = ckpt.load(trainer.train_state(), checkpoint)
        seconds = time.perf_counter() - start
    finally:
        ckpt.close()
    state = full_train_state(trainer)
    return {
        **_layout(trainer),
        "step": step,
        "load_s": seconds,
        "state": state if trainer.dist.is_main else None,
    }


def where_the_bytes_go(overrides: dict) -> dict:
    """In each rank of a data-parallel job: train and save (titanlite's balanced save plan), then
    load that checkpoint twice - DCP's default plan, then read-once - into the trainer's state.
    Returns this rank's bytes written and read each way, the checkpoint's data bytes, and a digest
    of the state each load produced (equal digests: the same state)."""
    from ..config import load_config
    from ..tools.measure.checkpoint_io import (
        CountingReader,
        bytes_written_per_rank,
        data_bytes,
        state_digest,
    )
    from ..train import Trainer

    trainer = Trainer(load_config(None, overrides))
    run_dir = trainer.fit().run_dir
    step = committed(run_dir / "checkpoints")[-1]
    rank = trainer.dist.rank
    out = {
        "rank": rank,
        "written": bytes_written_per_rank(step).get(rank, 0),
        "size": data_bytes(step),
        "read": {},
        "digest": {},
    }
    for read_once in (False, True):
        state, reader = trainer.train_state(), CountingReader(step)
        Checkpointer(step.parent, read_once=read_once).load(state, step, reader=reader)
        out["read"][read_once], out["digest"][read_once] = (
            reader.bytes_read,
            state_digest(state.state_dict()),
        )
    trainer.close(barrier=True)
    return out
