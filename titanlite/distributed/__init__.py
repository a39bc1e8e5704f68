"""Parallelism, one idea per module (notebooks 07-11):

    env.py           join the job torchrun started: rank, device, backend (gloo / nccl)
    mesh.py          ParallelDims: the ranks as a (dp_replicate, dp_shard) grid, a DeviceMesh
    scratch_ddp.py   data parallel by hand: broadcast, bucketed all-reduce, no_sync (teaching)
    scratch_tp.py    tensor parallel by hand: a column → row parallel MLP, Megatron's f and g (09)
    ddp.py           apply_ddp: torch's DistributedDataParallel; grad_sync for accumulation
    fsdp.py          apply_fsdp: FSDP2 fully_shard per block, meta-device init, FP8 all-gather
    zero.py          the ZeRO memory model, and the bytes each rank really stores
    tensor_parallel.py  apply_tp: column/row-parallel matmuls, sequence and loss parallel (09)
    pipeline.py      pipeline_split, torch's schedules (GPipe, 1F1B, interleaved, zero-bubble) (10)
    pipeline_timeline.py  per-micro-batch timings, Gantt chart, measured bubble (10)
    planner.py       choosing degrees for a model, a cluster and its memory (11)
    comm.py          CommCounter: every collective of a step, counted with its bytes
    parallelize.py   the ordered chain build → FP8 → AC → compile → DDP/FSDP
    launcher.py      launch / launch_function: torchrun from a notebook cell, live, no orphans

The notebooks' experiments, run inside every rank, live in `titanlite.labs` (nb07_... to nb11_...).
"""
from .launcher import LaunchResult, launch, launch_function

__all__ = ["LaunchResult", "launch", "launch_function"]
