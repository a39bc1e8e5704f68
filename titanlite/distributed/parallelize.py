"""Putting the model on many processes: torchtitan's ordered chain of small `apply_*` steps.

    built = parallelize(model_args, dims, mesh, device, dtype, cfg.parallel, Techniques.of(cfg),
                        example_shape=(micro_batch, seq_len))
    built.parts, built.pipeline          # this rank's model parts; the pipeline (None: no PP)

1. build    - pure FSDP: on the meta device, sharded before the weights exist; TP/PP: the whole model.
2. PP split - first: everything below applies per stage.
3. TP, EP   - TP's plan names the plain model's Linear modules and replaces their weights; EP
              keeps this rank's experts.
4. FP8      - swaps nn.Linear for Float8Linear: everything later sees the final modules.
5. AC       - wraps each block, so the wrapper is what compile and FSDP see.
6. compile  - per block, before FSDP: the hooks FSDP installs stay outside the graphs.
7. CP, mask - hand attention the cp group (after compile's trial, which runs one block alone), and
              the kernel that takes a document mask.
8. DDP/FSDP - last: they wrap or shard whatever the model finally is.

Each technique's part of torch (or torchao) is imported only where a run asks for the technique."""

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from .._compat.torch_internals import is_compiled_in_place
from ..config import (
    ActivationCheckpointSection,
    CompileSection,
    Float8Section,
    ParallelSection,
)
from ..errors import TitanliteError
from ..models.llama import ModelArgs, Transformer, build_model
from .ddp import apply_ddp
from .mesh import ParallelDims


# The config sections the chain of apply_* reads, and nothing else of the config; and the
# kernel that takes a mask where one is asked for (`masked_kernel`).
@dataclass(frozen=True)
class Techniques:
    float8: Float8Section
    activation_checkpoint: ActivationCheckpointSection
    compile: CompileSection
    masked_attention: str | None = None  # the kernel under a mask (sdpa, flex); None: no mask

    @classmethod
    def of(cls, cfg) -> "Techniques":
        return cls(cfg.float8, cfg.activation_checkpoint, cfg.compile, masked_kernel(cfg))


@dataclass
class Parallelized:
    """What `parallelize` built on this rank."""

    parts: list[nn.Module]  # the model (one part), or the pipeline stages this rank holds
    pipeline: object | None  # distributed/pipeline.Pipeline over those stages; None without PP


def parallelize(
    args: ModelArgs,
    dims: ParallelDims,
    mesh,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelSection,
    techniques: Techniques,
    *,
    example_shape: tuple[int, int],
    autocast_dtype: torch.dtype | None = None,
) -> Parallelized:
    """This rank's model parts and pipeline, built by the eight steps above in their order.
    `example_shape`: (micro-batch, sequence length), and `autocast_dtype`: the run's mixed
    precision, which the trial compile runs under."""
    fsdp = dims.sharded
    # Pure FSDP builds the model on the meta device: sharded before its weights exist (step 8).
    on_meta = fsdp and dims.tp == dims.pp == dims.ep == 1
    # The dtype FSDP gathers weights in (None: they already are in it, or no FSDP)
    gathered = getattr(torch, parallel.param_dtype) if fsdp else None
    gathered = gathered if gathered != dtype else None

    def steps_3_to_8(part: nn.Module) -> nn.Module:  # on the whole model, or on each stage
        if dims.tp > 1:
            from .tensor_parallel import apply_tp  # torch.distributed.tensor.parallel: tp > 1 only

            apply_tp(
                part,
                mesh["tp"],
                sequence_parallel=sequence_parallel_enabled(parallel, dims),
                loss_parallel=loss_parallel_enabled(parallel, dims),
            )
        if dims.ep > 1:
            from .expert_parallel import apply_ep  # ep > 1 only

            apply_ep(part, mesh["ep"])
        # On the meta device the FP8 and compile checks' trial runs must not move the RNG before
        # rank 0 draws the weights. FSDP gathers the weights in its param_dtype: the trial
        # compile runs them in it, as training will.
        with torch.random.fork_rng(devices=[], enabled=on_meta):
            part = apply_efficiency(
                part, device, techniques, example_shape, autocast_dtype, gathered
            )
        if dims.cp > 1:  # after the trial compile, which runs a block alone
            from .context_parallel import apply_cp  # cp > 1 only

            # attention runs in autocast's dtype, else in FSDP's gathered one, else the weights'
            attention_dtype = autocast_dtype or gathered or dtype
            apply_cp(
                part, mesh["cp"], parallel.cp_layout, parallel.cp_method, device, attention_dtype
            )
        if techniques.masked_attention:
            from ..models.masked_attention import apply_masked_attention  # masked runs only

            apply_masked_attention(part, techniques.masked_attention)
        return apply_data_parallel(part, args, dims, mesh, parallel, device, dtype, gathered)

    model = build(args, device, dtype, on_meta)
    stages, parts = apply_pp(model, dims, mesh, parallel, device)
    parts = [steps_3_to_8(part) for part in parts]
    if not stages:
        return Parallelized(parts, None)
    from .pipeline import Pipeline  # torch.distributed.pipelining: pp > 1 only

    for stage, part in zip(stages, parts):
        stage.submod = part  # the stage runs the parallelized module
    # The schedule is built over the stages' final (parallelized) modules
    return Parallelized(parts, Pipeline(stages, mesh["pp"], parallel, micro_batch=example_shape[0]))


def masked_kernel(cfg) -> str | None:
    """The kernel that takes a document mask where a run asks for one, as [model] attention says
    (sdpa or flex, once resolved for the device); None without a mask (causal SDPA, as always)."""
    return cfg.model.attention if cfg.data.document_mask else None


def build(args: ModelArgs, device: torch.device, dtype: torch.dtype, on_meta: bool) -> nn.Module:
    """1. The whole model: on the meta device (no memory; FSDP's rank 0 draws the weights later),
    or initialised on the CPU (the same seed gives the same weights on every device and layout)."""
    if on_meta:
        with torch.device("meta"):
            return Transformer(args).to(dtype)
    return build_model(args, "cpu").to(device=device, dtype=dtype)


def apply_pp(model: nn.Module, dims: ParallelDims, mesh, parallel: ParallelSection, device):
    """2. (stages, parts): this rank's pipeline stages and their modules; without PP, no stage and
    the one model."""
    if dims.pp == 1:
        return [], [model]
    from .pipeline import pipeline_split  # torch.distributed.pipelining: pp > 1 only

    return pipeline_split(
        model,
        mesh["pp"],
        schedule=parallel.pp_schedule,
        stages_per_rank=parallel.pp_stages_per_rank,
        device=device,
    )


def apply_data_parallel(
    part: nn.Module,
    args: ModelArgs,
    dims: ParallelDims,
    mesh,
    parallel: ParallelSection,
    device: torch.device,
    dtype: torch.dtype,
    gathered: torch.dtype | None,
) -> nn.Module:
    """8. FSDP (sharded over dp_shard × ep × cp; HSDP: and replicated across dp_replicate), or
    DDP, or nothing: last, so they wrap or shard whatever the part finally is."""
    if dims.strategy == "ddp":
        return apply_ddp(part, mesh["dp_replicate"], bucket_cap_mb=parallel.bucket_cap_mb)
    if dims.strategy not in ("fsdp", "hsdp"):
        return part
    from .fsdp import apply_fsdp, shard_and_init  # torch.distributed.fsdp: sharded runs only

    fsdp_kwargs = dict(
        param_dtype=gathered,
        reduce_dtype=getattr(torch, parallel.reduce_dtype),
        cpu_offload=parallel.cpu_offload,
        pp=dims.pp,
        reshard_after_forward=parallel.reshard_after_forward,
    )
    # CP ranks hold the same weights: FSDP shards them over dp_shard × cp.
    dp_mesh = dims.fsdp_mesh(mesh)
    if dims.tp == dims.pp == dims.ep == 1:  # on the meta device: rank 0 draws, then shards out
        return shard_and_init(
            part, lambda: build_model(args, "cpu").to(dtype), dp_mesh, device, **fsdp_kwargs
        )
    if dims.ep > 1:  # ep has split the experts: FSDP shards them over the ranks holding the same
        fsdp_kwargs.update(expert_parallel=True, expert_mesh=dims.fsdp_mesh(mesh, experts=True))
    return apply_fsdp(part, dp_mesh, **fsdp_kwargs)


def sequence_parallel_enabled(parallel: ParallelSection, dims: ParallelDims) -> bool:
    # Under PP the hidden states travel whole: a stage cannot see a sequence slice's full length (RoPE).
    return parallel.sequence_parallel and dims.pp == 1


def loss_parallel_enabled(parallel: ParallelSection, dims: ParallelDims) -> bool:
    # Under PP torch's schedule expects a plain loss tensor: the last stage gathers the logits instead.
    return parallel.loss_parallel and dims.tp > 1 and dims.pp == 1


def loss_context_for(parallel: ParallelSection, dims: ParallelDims):
    """What the loss and its backward run under: TP's loss parallel (on vocab-sharded logits), or nothing."""
    if not loss_parallel_enabled(parallel, dims):
        return contextlib.nullcontext
    from .tensor_parallel import loss_context  # tp > 1 only

    return lambda: loss_context(True)


def apply_efficiency(
    model: nn.Module,
    device: torch.device,
    techniques: Techniques,
    example_shape: tuple[int, int],
    autocast_dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """4-6. FP8, then AC, then compile (the order: above). The trial compile runs a real block on a
    batch of `example_shape` under `autocast_dtype` with its weights in `param_dtype` (FSDP's,
    where it gathers them in another dtype), so a failure falls back here, not at step 1."""
    f, ac, c = techniques.float8, techniques.activation_checkpoint, techniques.compile
    if f.enable:
        from ..efficiency.fp8 import apply_fp8, set_precision_casts_for  # torchao: FP8 runs only

        model = apply_fp8(
            model,
            recipe=f.recipe,
            device=device,
            min_dim=f.min_dim,
            emulate=None if f.emulate == "auto" else f.emulate == "true",  # None: as the GPU allows
            fsdp_all_gather=f.fsdp_all_gather,
        )
        if c.enable:
            set_precision_casts_for(f.recipe, compiled=True)
    if ac.mode != "none":
        from ..efficiency.activation_checkpoint import apply_ac  # torch.utils.checkpoint: AC only

        model = apply_ac(model, ac.mode, every=ac.every)
    if c.enable:
        from ..efficiency.compile import apply_compile  # Dynamo and Inductor: compiled runs only

        backend = {} if c.backend == "inductor" else {"backend": c.backend}
        model = apply_compile(
            model,
            scope=c.scope,
            fallback=c.fallback,
            device=device,
            example_shape=example_shape,
            autocast_dtype=autocast_dtype,
            param_dtype=param_dtype,
            **backend,
        )
    if f.enable and not model.fp8_info["emulated"] and not is_compiled_in_place(model):
        # Real FP8 uncompiled casts every operand unfused: slower than bf16. Asked for compile, it
        # can still end up eager: the trial compile failed and fell back (device_policy refuses
        # the asking; this, the ending up).
        raise TitanliteError(
            "real FP8 needs torch.compile, which cannot run here (the trial fell back to eager): "
            "fix compile (see the warning above), or set --float8.emulate true, or train in bf16"
        )
    return model
