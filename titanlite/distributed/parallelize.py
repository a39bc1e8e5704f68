"""Putting the model on many processes: torchtitan's ordered chain of small `apply_*` steps.

    parts, pipe = parallelize(model_args, cfg, dist_env, dims, mesh, dtype)

Order matters, and each step says why it comes where it does:
1. build    - pure FSDP builds on the meta device (no memory, no init) and shards before the
              weights exist; TP and PP start from the whole model (same seed on every rank).
2. PP split - cut the layers into stages first: everything below applies per stage.
3. TP       - its plan names the plain model's Linear modules and replaces their weights.
4. FP8      - swaps nn.Linear for Float8Linear: everything later sees the final modules.
5. AC       - wraps each block, so the wrapper is what compile and FSDP see.
6. compile  - per block, before FSDP: the hooks FSDP installs stay outside the graphs.
7. DDP/FSDP - last: they wrap or shard whatever the model finally is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..efficiency import apply_efficiency
from ..errors import TitanliteError
from ..models.llama import ModelArgs, Transformer, build_model
from .ddp import apply_ddp
from .env import DistEnv
from .fsdp import apply_fsdp, shard_and_init
from .mesh import ParallelDims


def parallelize(args: ModelArgs, cfg, env: DistEnv, dims: ParallelDims, mesh,
                dtype: torch.dtype, autocast_dtype: torch.dtype | None = None
                ) -> tuple[list[nn.Module], "Pipeline | None"]:
    """This rank's model parts (one, or one per pipeline stage it holds) and the pipeline.
    `autocast_dtype`: the run's mixed precision, which the trial compile runs under."""
    check_parallel_config(cfg, dims, args)
    p = cfg.parallel
    fsdp = dims.strategy in ("fsdp", "hsdp")
    fsdp_kwargs = dict(param_dtype=getattr(torch, p.param_dtype) if p.param_dtype != str(dtype)[6:] else None,
                       reduce_dtype=getattr(torch, p.reduce_dtype),
                       reshard_after_forward=p.reshard_after_forward, cpu_offload=p.cpu_offload,
                       pp=dims.pp)
    # HSDP shards within a replica group and all-reduces across groups: a 2-D mesh.
    dp_mesh = None if mesh is None else (mesh["dp_replicate", "dp_shard"] if dims.strategy == "hsdp"
                                         else mesh["dp_shard"])
    if fsdp and dims.tp == 1 and dims.pp == 1:
        with torch.device("meta"):
            model = Transformer(args).to(dtype)
        # The weights are drawn later (rank 0, below), so the trial runs that the FP8 and
        # compile support checks make must not move the random generator in between.
        with torch.random.fork_rng(devices=[]):
            model = apply_efficiency(model, cfg, env.device, autocast_dtype)
        return [shard_and_init(model, lambda: build_model(args, "cpu").to(dtype), dp_mesh,
                               env.device, **fsdp_kwargs)], None
    # Initialised on the CPU whatever the device: the same seed gives the same weights on
    # every device and under every layout.
    model = build_model(args, "cpu").to(device=env.device, dtype=dtype)
    pipe = None
    if dims.pp > 1:
        from .pipeline import pipeline_split
        stages, parts = pipeline_split(model, mesh["pp"], schedule=p.pp_schedule,
                                       stages_per_rank=p.pp_stages_per_rank, device=env.device)
        pipe = Pipeline(stages, cfg, mesh["pp"])
    else:
        stages, parts = [], [model]
    for i, part in enumerate(parts):
        if dims.tp > 1:
            from .tensor_parallel import apply_tp
            apply_tp(part, mesh["tp"], sequence_parallel=sequence_parallel_enabled(cfg, dims),
                     loss_parallel=loss_parallel_enabled(cfg, dims))
        part = apply_efficiency(part, cfg, env.device, autocast_dtype)
        if fsdp:
            part = apply_fsdp(part, dp_mesh, **fsdp_kwargs)
        elif dims.strategy == "ddp":
            part = apply_ddp(part, mesh["dp_replicate"], bucket_cap_mb=p.bucket_cap_mb)
        parts[i] = part
        if stages:
            stages[i].submod = part  # the stage runs the parallelized module
    if pipe is not None:
        pipe.build_schedule(parts)
    return parts, pipe


def sequence_parallel_enabled(cfg, dims: ParallelDims) -> bool:
    # Between pipeline stages the hidden states travel whole: a stage's input would otherwise
    # be a sequence slice whose full length (for RoPE) the stage cannot see.
    return cfg.parallel.sequence_parallel and dims.pp == 1


def loss_parallel_enabled(cfg, dims: ParallelDims) -> bool:
    # Under PP the last stage's loss goes through torch's schedule, which expects a plain
    # tensor: the logits are gathered there (loss parallel applies to tp-only layouts).
    return cfg.parallel.loss_parallel and dims.tp > 1 and dims.pp == 1


def check_parallel_config(cfg, dims: ParallelDims, args: ModelArgs | None = None) -> None:
    """Combinations that cannot work, refused before any model is built."""
    fsdp = dims.strategy in ("fsdp", "hsdp")
    p, t = cfg.parallel, cfg.training
    if cfg.float8.enable and cfg.float8.fsdp_all_gather and not fsdp:
        raise TitanliteError("float8.fsdp_all_gather needs FSDP (parallel.dp_shard > 1), but this run "
                             f"is '{dims.strategy}': drop --float8.fsdp_all_gather or run under FSDP")
    if fsdp and t.mixed_precision == "fp16":
        raise TitanliteError("fp16 with a GradScaler is not supported with FSDP here (every rank "
                             "would have to agree on skipped steps): use --training.mixed_precision "
                             "bf16, or --parallel.param_dtype bfloat16")
    if not fsdp and (p.param_dtype != "float32" or p.cpu_offload) and dims.world_size > 1:
        raise TitanliteError(f"parallel.param_dtype / parallel.cpu_offload are FSDP options, but "
                             f"this run is '{dims.strategy}': set parallel.dp_shard > 1, or use "
                             f"training.mixed_precision for autocast")
    if dims.strategy == "ddp" and (dims.tp > 1 or dims.pp > 1):
        raise TitanliteError("combine tensor or pipeline parallelism with FSDP (parallel.dp_shard), "
                             "not DDP: set --parallel.dp_replicate 1 and --parallel.dp_shard -1")
    if (dims.tp > 1 or dims.pp > 1) and cfg.float8.enable:
        raise TitanliteError("FP8 with tensor or pipeline parallelism is not supported here: turn off "
                             "--float8.enable, or use FSDP only")
    if (dims.pp > 1 or dims.tp > 1) and t.mixed_precision == "fp16":
        raise TitanliteError("fp16 + GradScaler is not supported with tensor or pipeline parallelism "
                             "(each rank would check only its own shard for overflow): use "
                             "--training.mixed_precision bf16")
    if args is not None and dims.tp > 1:
        from .tensor_parallel import check_tp
        check_tp(args, dims.tp, seq_len=t.seq_len, sequence_parallel=sequence_parallel_enabled(cfg, dims))
    if dims.pp > 1 and p.pp_schedule == "zbv" and cfg.eval.every:
        raise TitanliteError("torch's zero-bubble V schedule cannot run forward-only, so it cannot "
                             "evaluate: set --eval.every 0, or use --parallel.pp_schedule interleaved_zb")
    if args is not None and dims.pp > 1:
        from .pipeline import check_pipeline
        check_pipeline(pp=dims.pp, schedule=p.pp_schedule, n_layers=args.n_layers,
                       n_microbatches=microbatches(cfg, dims), batch_size=t.batch_size,
                       stages_per_rank=p.pp_stages_per_rank, tie_embeddings=args.tie_embeddings)


def microbatches(cfg, dims: ParallelDims) -> int:
    p = cfg.parallel
    if p.pp_microbatches:
        return p.pp_microbatches
    from .pipeline import SCHEDULES
    v = 1 if SCHEDULES[p.pp_schedule][1] == "single" else (p.pp_stages_per_rank or 2)
    return min(cfg.training.batch_size, 2 * dims.pp * v)


@dataclass
class Pipeline:
    """This rank's pipeline stages and torch's schedule over them, for the trainer."""
    stages: list
    cfg: object
    pp_mesh: object
    schedule: object = None
    loss_fn: object = None

    def build_schedule(self, parts) -> None:
        from .pipeline import TokenLoss, build_schedule
        self.loss_fn = TokenLoss()
        dims = ParallelDims(1, 1, self.pp_mesh.size(), pp=self.pp_mesh.size())
        self.schedule = build_schedule(self.cfg.parallel.pp_schedule, self.stages,
                                       microbatches(self.cfg, dims), self.loss_fn,
                                       batch_size=self.cfg.training.batch_size)

    def step(self, x: torch.Tensor, y: torch.Tensor, num_tokens: float) -> torch.Tensor:
        """Forward + backward of one batch through all stages; the loss on every stage."""
        from .pipeline import pipeline_step
        return pipeline_step(self.schedule, self.stages, x, y, loss_fn=self.loss_fn,
                             num_tokens=num_tokens, pp_group=self.pp_mesh)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Mean token loss of one batch, forward only through the same schedule."""
        from .pipeline import pipeline_eval
        return pipeline_eval(self.schedule, self.stages, x, y, loss_fn=self.loss_fn,
                             pp_group=self.pp_mesh).item()
