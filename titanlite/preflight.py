"""Preflight: every way a config can fail to make a run, checked once, before anything starts.

    plan = preflight(cfg, world_size=4, vocab_size=4096)
    plan.dims                   # the rank grid: pp × dp_replicate × dp_shard × ep × cp × tp
    plan.micro_batch, plan.grad_accum_steps, plan.global_batch
    plan.model_args             # the model's shape (a preset and its overrides, or a checkpoint's)

Run by each torchrun worker as its Trainer starts, and first by `launch`: bad input costs no process
start-up. Each refusal is one line naming the key and the fix. No device or process group is touched."""

import os
from dataclasses import dataclass

import torch

from .config import Config
from .data.tokenizer import load_tokenizer
from .distributed.mesh import ParallelDims
from .distributed.parallelize import sequence_parallel_enabled
from .efficiency.accumulation import resolve_batch
from .errors import TitanliteError, refuse_first
from .models.llama import ModelArgs, count
from .optimizer import check_optimizer
from .resilience.fault_tolerance_config import replica_group
from .resilience.faults import check_fault


@dataclass(frozen=True)
class Plan:
    dims: ParallelDims
    micro_batch: int
    grad_accum_steps: int
    global_batch: int
    model_args: ModelArgs


def preflight(cfg: Config, world_size: int, vocab_size: int, start_from=None) -> Plan:
    """Check `cfg` for a job of `world_size` processes whose tokenizer has `vocab_size` tokens
    (`tokenizer_size`); `start_from`: a published model (tools.formats.hf_start.HuggingFaceStart) sets the shape."""
    cfg.validate()
    p, t = cfg.parallel, cfg.training
    dims = ParallelDims.resolve(
        p.dp_replicate, p.dp_shard, world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep
    )
    check_fault(cfg.fault, t.steps, world_size)
    micro, accum, global_batch = resolve_batch(
        t.batch_size, t.grad_accum_steps, t.global_batch_size, dp_degree=dims.batch_ranks
    )
    args = model_args_for(cfg, vocab_size, start_from)
    check_parallel_config(cfg, dims, args)
    if cfg.fault_tolerance.enable:  # one replica group of several, a data slice its own
        dims = replica_group(cfg.fault_tolerance, dims, t.mixed_precision, args.moe)
    check_optimizer(cfg.optimizer, dims, cpu_offload=cfg.parallel.cpu_offload)
    return Plan(dims, micro, accum, global_batch, args)


def tokenizer_for(cfg: Config, start_from=None) -> str | None:
    """The corpus's tokenizer: `data.tokenizer`, else the published model's (`start_from`), else None."""
    return cfg.data.tokenizer or (start_from.tokenizer if start_from else None)


def tokenizer_size(cfg: Config, start_from=None) -> int:
    """The run's tokenizer's vocabulary: the given one's, else data.vocab_size (titanlite trains one)."""
    path = tokenizer_for(cfg, start_from)
    return len(load_tokenizer(path)) if path else cfg.data.vocab_size


def model_args_for(cfg: Config, vocab_size: int, start_from=None) -> ModelArgs:
    """The model's shape: a published model's (`start_from`), else the preset with the [model]
    overrides; checked against the tokenizer and seq_len."""
    m = cfg.model
    if cfg.checkpoint.initial_load_path and start_from is None:
        raise TitanliteError(
            "checkpoint.initial_load_path starts from a Hugging Face model, which a tool "
            "reads: pass Trainer(cfg, start_from=HuggingFaceStart.from_config(cfg)) "
            "(titanlite.tools.formats.hf_start); `titanlite train` does"
        )
    if start_from is not None:
        args = start_from.model_args(cfg)
    else:
        args = ModelArgs.preset(
            m.preset,
            dim=m.dim,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            n_kv_heads=m.n_kv_heads,
            # unset: debug and small take the tokenizer's; larger presets keep theirs (true counts)
            vocab_size=m.vocab_size or (vocab_size if m.preset in ("debug", "small") else None),
            max_seq_len=m.max_seq_len,
            tie_embeddings=m.tie_embeddings,
            moe=moe_args_of(m),
        )
    refuse_first(
        (
            args.vocab_size < vocab_size,
            f"the tokenizer has {vocab_size} tokens but the model's vocab_size is "
            f"{args.vocab_size}, so token ids would be out of range: set --model.vocab_size "
            f"{vocab_size} (or leave it unset), or use a smaller tokenizer",
        ),
        (
            cfg.training.seq_len > args.max_seq_len,
            f"training.seq_len={cfg.training.seq_len} exceeds the model's maximum "
            f"({args.max_seq_len} for preset '{m.preset}'): lower --training.seq_len or "
            "raise --model.max_seq_len",
        ),
    )
    return args


def moe_args_of(m):
    """[model]'s mixture-of-experts keys as MoEArgs; None for a dense model (0 experts)."""
    if m.n_experts == 0:
        return None
    from .models.moe import MoEArgs  # a mixture only: a dense run never imports it

    return MoEArgs(
        n_experts=m.n_experts,
        experts_per_token=m.experts_per_token,
        n_shared_experts=m.n_shared_experts,
        every=m.moe_every,
        hidden_dim=m.expert_hidden_dim,
        router=m.moe_router,
        balance=m.moe_balance,
        aux_loss_coef=m.moe_aux_loss_coef,
        bias_update=m.moe_bias_update,
        capacity_factor=m.moe_capacity_factor,
    )


def check_parallel_config(cfg: Config, dims: ParallelDims, args: ModelArgs) -> None:
    """Combinations of layout and techniques that cannot work, refused before any model exists."""
    fsdp = dims.sharded
    p, t = cfg.parallel, cfg.training
    n_experts = args.moe.n_experts if args.moe else 0
    pieces = 2 * dims.cp if p.cp_layout == "zigzag" else dims.cp  # zigzag: 2 chunks a rank
    refuse_first(
        (
            cfg.float8.enable and cfg.float8.fsdp_all_gather and not fsdp,
            "float8.fsdp_all_gather needs FSDP (parallel.dp_shard > 1), but this run "
            f"is '{dims.strategy}': drop --float8.fsdp_all_gather or run under FSDP",
        ),
        (
            fsdp and t.mixed_precision == "fp16",
            "fp16 with a GradScaler is not supported with FSDP here (every rank "
            "would have to agree on skipped steps): use --training.mixed_precision "
            "bf16, or --parallel.param_dtype bfloat16",
        ),
        (
            not fsdp and (p.param_dtype == "bfloat16" or p.cpu_offload) and dims.world_size > 1,
            f"parallel.param_dtype / parallel.cpu_offload are FSDP options, but "
            f"this run is '{dims.strategy}': set parallel.dp_shard > 1, or use "
            f"training.mixed_precision for autocast",
        ),
        (
            dims.strategy == "ddp" and (dims.tp > 1 or dims.pp > 1),
            "combine tensor or pipeline parallelism with FSDP (parallel.dp_shard), "
            "not DDP: set --parallel.dp_replicate 1 and --parallel.dp_shard -1",
        ),
        (
            (dims.tp > 1 or dims.pp > 1) and cfg.float8.enable,
            "FP8 with tensor or pipeline parallelism is not supported here: turn off "
            "--float8.enable, or use FSDP only",
        ),
        (
            (dims.pp > 1 or dims.tp > 1) and t.mixed_precision == "fp16",
            "fp16 + GradScaler is not supported with tensor or pipeline parallelism "
            "(each rank would check only its own shard for overflow): use "
            "--training.mixed_precision bf16",
        ),
    )
    if dims.tp > 1:
        from .distributed.tensor_parallel import check_tp  # loads TP's part of torch: tp > 1 only

        check_tp(
            args,
            dims.tp,
            seq_len=t.seq_len // dims.cp,  # what a cp rank holds of each sequence
            sequence_parallel=sequence_parallel_enabled(p, dims),
        )
    refuse_first(  # then what context and expert parallelism and the schedule need
        (
            dims.cp > 1 and t.seq_len % pieces,
            f"training.seq_len={t.seq_len} does not cut into {pieces} equal chunks for "
            f"--parallel.cp {dims.cp} ({p.cp_layout}): use a seq_len that is a multiple of {pieces}",
        ),
        (
            dims.cp > 1 and p.cp_method == "ring" and cfg.data.document_mask,
            "--data.document_mask under --parallel.cp needs --parallel.cp_method allgather: a ring "
            "rank sees one block of keys at a time (Llama 3 paper §3.3.2: why it chose all-gather)",
        ),
        (
            dims.ep > 1 and not n_experts,
            f"--parallel.ep {dims.ep} splits the experts of a mixture of experts, and this model "
            f"has none: set --model.n_experts (a multiple of {dims.ep}), or leave ep at 1",
        ),
        (
            n_experts % dims.ep,
            f"model.n_experts={n_experts} does not divide over --parallel.ep {dims.ep}: "
            f"choose n_experts a multiple of ep",
        ),
        # pp: a stage's shape-learning forward would move the router's balance; tp × ep: not built
        (
            n_experts and (dims.pp > 1 or (dims.tp > 1 and dims.ep > 1)),
            "a mixture of experts with pipeline parallelism, or split by tensor and expert "
            "parallelism together, is not supported here: split the experts with --parallel.ep "
            "or --parallel.tp, the rest with FSDP (--parallel.dp_shard)",
        ),
        (
            dims.pp > 1 and p.pp_schedule == "zbv" and cfg.eval.every,
            "torch's zero-bubble V schedule cannot run forward-only, so it cannot "
            "evaluate: set --eval.every 0, or use --parallel.pp_schedule interleaved_zb",
        ),
    )
    if dims.pp > 1:
        from .distributed.pipeline import check_pipeline, microbatches  # pipelining: pp > 1 only

        check_pipeline(
            pp=dims.pp,
            schedule=p.pp_schedule,
            n_layers=args.n_layers,
            n_microbatches=microbatches(p, t.batch_size, dims.pp),
            batch_size=t.batch_size,
            stages_per_rank=p.pp_stages_per_rank,
            tie_embeddings=args.tie_embeddings,
        )


def memory_floor(plan: Plan, cfg: Config) -> tuple[float, float]:
    """A lower bound of what one process holds at once, in bytes, as (state, per_sequence): its
    shard of the weights, their gradients and AdamW's two fp32 moments; and what each sequence of
    its micro-batch adds: its seq_len/cp tokens' logits, vocab/tp wide, and their gradient (in at
    least 16 bits each), and the tokens. FSDP shards over dp_shard × ep × cp (the experts, which ep
    has split already, over dp_shard); TP and PP split every weight (notebook 17 writes it out)."""
    args, dims, t = plan.model_args, plan.dims, cfg.training
    _, params = count(args, t.seq_len)  # on the meta device: counted, not allocated
    moe = args.moe
    moe_layers = sum((i + 1) % moe.every == 0 for i in range(args.n_layers)) if moe else 0
    experts = moe_layers * (  # the experts' parameters (none in a dense model)
        moe.n_experts * 3 * (moe.hidden_dim or args.hidden_dim) * args.dim if moe else 0
    )
    fsdp = dims.dp_shard if dims.sharded else 1
    shard = ((params - experts) / (fsdp * dims.ep * dims.cp) + experts / (fsdp * dims.ep)) / (
        dims.tp * dims.pp
    )
    param_bytes = 2 if t.dtype in ("bfloat16", "float16", "bf16", "fp16") else 4
    per_sequence = t.seq_len / dims.cp * (args.vocab_size / dims.tp * 2 * param_bytes + 16)
    return shard * (2 * param_bytes + 8), per_sequence


def check_memory_fits(plan: Plan, cfg: Config, limit: int | None, where: str) -> None:
    """Refuse sizes that cannot fit in `limit` bytes (memory.memory_limit_bytes) before anything
    is allocated: `memory_floor`, a lower bound, so it never refuses a run that fits."""
    args, t = plan.model_args, cfg.training
    state, per_sequence = memory_floor(plan, cfg)
    need = state + plan.micro_batch * per_sequence
    if limit is None or need <= limit:  # None: this machine's memory is unknown
        return
    fits = int((limit - state) // per_sequence)
    fix = (
        f"lower --training.batch_size (at most {fits:,} sequences of {t.seq_len} fit) or "
        f"--training.seq_len"
        if fits >= 1
        else "choose a smaller model, or shard it over more processes"
    )
    _, params = count(args, t.seq_len)
    raise TitanliteError(
        f"micro-batch {plan.micro_batch:,} × seq_len {t.seq_len:,} of a {params / 1e6:,.1f}M-"
        f"parameter model needs at least {need / 2**30:,.1f} GiB in one process (logits "
        f"{args.vocab_size:,} wide and their gradient, tokens, weights, gradients and AdamW), but "
        f"{where} has {limit / 2**30:,.1f} GiB: {fix}"
    )


def prepare_process(plan: Plan, cfg: Config) -> None:
    """This process, made ready before anything allocates: its CPU threads, the CUDA allocator's
    settings (read once, at its first allocation), and `check_memory_fits` against this machine's
    memory (the device's, or for the CPU the host's RAM shared by the ranks on it)."""
    from . import hardware
    from .device_policy import allocator_settings
    from .memory import memory_limit_bytes

    if cfg.training.threads:
        torch.set_num_threads(cfg.training.threads)
    device = hardware.detect_device(cfg.training.device)
    hardware.use_allocator_settings(allocator_settings(device.type))
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    limit = memory_limit_bytes(device)
    check_memory_fits(
        plan,
        cfg,
        limit and limit // sharing,
        where=hardware.device_name(device) + (f" (÷ {sharing} ranks)" if sharing > 1 else ""),
    )
