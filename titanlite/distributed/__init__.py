"""Parallelism, one idea per module (notebooks 07-11, 17, 18):

env.py           join the job torchrun started: rank, device, backend (gloo / nccl)
mesh.py          ParallelDims: the ranks as a (pp, dp_replicate, dp_shard, ep, cp, tp) grid, a DeviceMesh
ddp.py           apply_ddp: torch's DistributedDataParallel; grad_sync for accumulation
fsdp.py          apply_fsdp: FSDP2 fully_shard per block, meta-device init, FP8 all-gather
tensor_parallel.py  apply_tp: column/row-parallel matmuls, sequence and loss parallel (09)
pipeline.py      pipeline_split, torch's schedules (GPipe, 1F1B, interleaved, zero-bubble) (10)
context_parallel.py  apply_cp: each sequence split over ranks, ring attention across them (17)
expert_parallel.py   apply_ep: each rank holds some experts; tokens travel to them by all-to-all (18)
parallelize.py   the ordered chain build → PP split → TP, EP → FP8 → AC → compile → CP → DDP/FSDP"""
