"""Putting the model on many processes: torchtitan's ordered chain of small `apply_*` steps.

    model = parallelize(model_args, cfg, dist_env, dims, mesh, dtype)

Order matters, and each step says why it comes where it does:
1. build   - FSDP builds on the meta device (no memory, no init) so even a model too large
             for one rank can be sharded before it exists; DDP needs the whole model anyway.
2. FP8     - swaps nn.Linear for Float8Linear: everything later must see the final modules.
3. AC      - wraps each block, so the wrapper is what compile and FSDP see.
4. compile - per block, before FSDP: the hooks FSDP installs stay outside the graphs.
5. DDP / FSDP last - they wrap or shard whatever the model finally is.
"""
from __future__ import annotations

import torch
from torch import nn

from ..efficiency import apply_efficiency
from ..errors import TitanliteError
from ..models.llama import ModelArgs, Transformer, build_model
from .ddp import apply_ddp
from .env import DistEnv
from .fsdp import shard_and_init
from .mesh import ParallelDims


def parallelize(args: ModelArgs, cfg, env: DistEnv, dims: ParallelDims, mesh,
                dtype: torch.dtype) -> nn.Module:
    check_parallel_config(cfg, dims)
    p = cfg.parallel
    if dims.strategy in ("fsdp", "hsdp"):
        with torch.device("meta"):
            model = Transformer(args).to(dtype)
        # The weights are drawn later (rank 0, below), so the trial runs that the FP8 and
        # compile support checks make must not move the random generator in between.
        with torch.random.fork_rng(devices=[]):
            model = apply_efficiency(model, cfg, env.device)
        # HSDP shards within a replica group and all-reduces across groups: a 2-D mesh.
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.strategy == "hsdp" else mesh["dp_shard"]
        return shard_and_init(
            model, lambda: build_model(args, "cpu").to(dtype), dp_mesh, env.device,
            param_dtype=getattr(torch, p.param_dtype) if p.param_dtype != str(dtype)[6:] else None,
            reduce_dtype=getattr(torch, p.reduce_dtype),
            reshard_after_forward=p.reshard_after_forward, cpu_offload=p.cpu_offload)
    # Initialised on the CPU whatever the device: the same seed gives the same weights on
    # every device and under every layout (FSDP's rank 0 builds its copy on the CPU too).
    model = build_model(args, "cpu").to(device=env.device, dtype=dtype)
    model = apply_efficiency(model, cfg, env.device)
    if dims.strategy == "ddp":
        model = apply_ddp(model, mesh["dp_replicate"], bucket_cap_mb=p.bucket_cap_mb)
    return model


def check_parallel_config(cfg, dims: ParallelDims) -> None:
    """Combinations that cannot work, refused before any model is built."""
    fsdp = dims.strategy in ("fsdp", "hsdp")
    if cfg.float8.enable and cfg.float8.fsdp_all_gather and not fsdp:
        raise TitanliteError("float8.fsdp_all_gather needs FSDP (parallel.dp_shard > 1), but this run "
                             f"is '{dims.strategy}': drop --float8.fsdp_all_gather or run under FSDP")
    if fsdp and cfg.training.mixed_precision == "fp16":
        raise TitanliteError("fp16 with a GradScaler is not supported with FSDP here (every rank "
                             "would have to agree on skipped steps): use --training.mixed_precision "
                             "bf16, or --parallel.param_dtype bfloat16")
    if not fsdp and (cfg.parallel.param_dtype != "float32" or cfg.parallel.cpu_offload):
        if dims.world_size > 1:
            raise TitanliteError(f"parallel.param_dtype / parallel.cpu_offload are FSDP options, but "
                                 f"this run is '{dims.strategy}': set parallel.dp_shard > 1, or use "
                                 f"training.mixed_precision for autocast")
