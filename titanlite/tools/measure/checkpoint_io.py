"""Where a checkpoint's bytes go: written per rank (DCP's balanced save) and read per rank (read-once).

DCP saves each tensor that several ranks hold alike (DDP's weights and moments, HSDP's replicated
shards) once, on one of its holders (`dedup_save_plans`, in the items' order); titanlite's planner
(resilience/balanced_io.py) picks largest first, for the holder with the fewest bytes. On load DCP
has every rank read every replicated byte; titanlite reads each on one rank and broadcasts it.

    bytes_written_per_rank(step_dir)       # {rank: bytes}, from DCP's file names
    balance(per_rank)                      # max / mean: 1.0 is perfectly even
    launch_function("titanlite.tools.measure.checkpoint_io:load_bytes", nproc=2, overrides=o, ...)
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ...resilience.checkpoint_files import RawReader

_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")  # DCP's file per rank and writer thread


class CountingReader(RawReader):
    """titanlite's file reader, counting the bytes this rank asks storage for (`bytes_read`)."""

    def __init__(self, path):
        super().__init__(path)
        self.bytes_read = 0

    def read_data(self, plan, planner):
        self.bytes_read += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return super().read_data(plan, planner)


def bytes_written_per_rank(step_dir: str | Path) -> dict[int, int]:
    """Bytes each rank wrote into checkpoint `step_dir` (its index and commit record not counted)."""
    out: dict[int, int] = {}
    for f in Path(step_dir).iterdir():
        if m := _DATA_FILE.fullmatch(f.name):
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + f.stat().st_size
    return dict(sorted(out.items()))


def data_bytes(step_dir: str | Path) -> int:
    """The checkpoint's data: what one full read of it costs."""
    return sum(bytes_written_per_rank(step_dir).values())


def balance(per_rank: dict[int, int]) -> float:
    """max / mean of the bytes per rank (1.0: perfectly even)."""
    values = list(per_rank.values())
    return max(values) * len(values) / sum(values)


def load_bytes(overrides: dict, step_dir: str, read_once: bool) -> dict:
    """In each rank of a `launch_function` job: build the run `overrides` describe, load checkpoint
    `step_dir` into its state, and return the bytes this rank asked storage for and a digest of the
    loaded state (equal digests on every rank and both ways: the same state)."""
    from ...config import load_config
    from ...resilience.checkpoint import Checkpointer
    from ...train import Trainer

    trainer = Trainer(load_config(None, overrides))
    loader = Checkpointer(Path(step_dir).parent, read_once=read_once)
    state = trainer.train_state()
    reader = CountingReader(step_dir)
    step = loader.load(state, step_dir, reader=reader)
    loader.close()
    digest = state_digest(state.state_dict())
    trainer.close(barrier=True)
    return {"bytes_read": reader.bytes_read, "step": step, "digest": digest}


def state_digest(sd: dict) -> str:
    """SHA-256 over the names and bytes of the weights and optimizer tensors in a TrainState's state
    dict (DTensors gathered whole; collective under FSDP/TP): equal digests, equal states."""
    import hashlib

    digest = hashlib.sha256()
    for part in ("model", "optimizer"):
        for name, tensor in sorted(sd[part].items()):
            if isinstance(tensor, torch.Tensor):
                local = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                digest.update(f"{part}.{name}".encode())
                digest.update(
                    local.detach()
                    .cpu()
                    .contiguous()
                    .reshape(-1)
                    .view(torch.uint8)
                    .numpy()
                    .tobytes()
                )
    return digest.hexdigest()


def planned_bytes_per_rank(sd: dict, world_size: int, planner_class) -> list[int]:
    """Bytes each of `world_size` data-parallel ranks (all holding `sd`, as under DDP) would write
    under `planner_class`'s global plan (DCP's DefaultSavePlanner, or resilience's
    BalancedSavePlanner), computed in this process: a pickled value counts ~1 KB."""
    plans = []
    for rank in range(world_size):
        planner = planner_class()
        planner.set_up_planner(sd, is_coordinator=rank == 0)
        plans.append(planner.create_local_plan())
    coordinator = planner_class()
    coordinator.set_up_planner(sd, is_coordinator=True)
    final, _ = coordinator.create_global_plan(plans)
    return [sum(item.tensor_storage_size() or 1024 for item in plan.items) for plan in final]


def staging_reuse(state: dict, folder: str | Path, saves: int = 3) -> list[int]:
    """Async saves of `state` (weights changed between them): how many staging storages each save
    allocated that no earlier save had (the first allocates them all; a reused stager, none after)."""
    from ...resilience import async_saves
    from ...resilience.checkpoint import Checkpointer

    seen, new, held, make = set(), [], [], async_saves.make_stager

    def recording(options, shared_memory):
        stager = make(options, shared_memory)
        stage = stager.stage

        def stage_and_note(state_dict, **kw):
            future = stage(state_dict, **kw)
            staged = future.result() if hasattr(future, "result") else future
            held.append(staged)  # kept alive: a new allocation cannot take a freed buffer's address
            ptrs = {t.untyped_storage().data_ptr() for t in _tensors(staged)}
            new.append(len(ptrs - seen))
            seen.update(ptrs)
            return future

        stager.stage = stage_and_note
        return stager

    async_saves.make_stager = recording
    try:
        ckpt = Checkpointer(folder, mode="async", keep_latest_k=1)
        for step in range(1, saves + 1):
            for t in filter(torch.is_floating_point, _tensors(state)):
                t.add_(1.0)  # the next step's weights
            ckpt.save(state, step)
            ckpt.wait()
        ckpt.close()
    finally:
        async_saves.make_stager = make
    return new


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = (
        tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    )
    return [t for v in values for t in _tensors(v)]


def cpu_seconds_per_phase(state: dict, folder: str | Path) -> dict[str, dict[str, float]]:
    """Where a save's work goes, each phase timed alone on `state`: {phase: {"cpu_s", "wall_s"}} for
    the staging copy, the CRC-32 of the bytes, and writing them + fsync (as titanlite's RawWriter does);
    and, for comparison, what DCP's own writer adds: a torch.save container per tensor ("torch.save per
    tensor (DCP's writer)": not a phase of titanlite's save). On 2 cores this is what competes with a step."""
    import io
    import os
    import time
    import zlib

    tensors = _tensors(state)
    out: dict[str, dict[str, float]] = {}

    def timed(name, fn):
        cpu, wall = time.process_time(), time.perf_counter()
        result = fn()
        out[name] = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}
        return result

    copies = timed("copy", lambda: [t.detach().clone() for t in tensors])
    views = [t.reshape(-1).view(torch.uint8).numpy() for t in copies]
    timed("crc32", lambda: [zlib.crc32(v) for v in views])
    path = Path(folder) / "phase-write.bin"
    path.parent.mkdir(parents=True, exist_ok=True)

    def write():
        with open(path, "wb") as f:
            for v in views:
                f.write(v)
            f.flush()
            os.fsync(f.fileno())

    timed("write + fsync", write)
    path.unlink()
    timed(
        "torch.save per tensor (DCP's writer)",
        lambda: [torch.save(t, io.BytesIO()) for t in copies],
    )
    return out
