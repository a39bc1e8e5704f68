"""Choosing the degrees: which (pp, dp_replicate, dp_shard, ep, cp, tp) layout to train with, as code.

    p = plan(ModelArgs.preset("8B"), n_gpus=8, gpu_mem_bytes=80e9, seq_len=8192, micro_batch=1)
    p.explain()                                   # the choice, its memory, why not simpler ones
    launch(cfg, nproc=8, overrides=p.best.overrides)

Every layout whose degrees multiply to n_gpus is scored. The rules of thumb (torchtitan,
Megatron-LM, the Ultra-Scale Playbook) become explicit rules and a ranking:
- hard: the trainer must accept it (`check_parallel_config`: TP divides the heads, PP has a
  layer per stage, ...); a TP group stays inside one node (tp divides gpus_per_node: it talks
  in every layer); with a `global_batch`, every data-parallel rank gets whole micro-batches,
  at least pp of them; and the heaviest stage fits in (1 - reserve) of the GPU's memory.
- ranking: FSDP first (no pipeline, no TP: sharding costs only overlappable communication);
  then TP within a node; then context parallelism (`cp`: the degrees passed in, each sequence
  split over cp ranks, K/V passed in every attention layer); PP (across nodes, with its bubble)
  only when still needed; plain DDP
  when the whole model fits (2Ψ per step on the wire where ZeRO-3 moves 3Ψ); HSDP across nodes
  (shard within a node, replicate across) before FSDP spanning nodes; then the widest shard.

Memory per GPU, in bytes, of the heaviest pipeline stage:
- params / grads / optimizer: ZeRO's formula (zero.py) for Ψ_local, the stage's parameters with
  every matrix split tp ways (norm weights are replicated), sharded dp_shard ways (stage 3;
  stage 0 = DDP when dp_shard = 1; FSDP shards over dp_shard × cp, as the trainer does).
  dp_replicate saves nothing: each replica holds it all.
- activations of one layer and micro-batch in bf16: `activation_memory_estimate` (tools/predict/activation_memory.py:
  Korthikanti et al. 2022's count, "Reducing Activation Recomputation in Large Transformer
  Models", re-derived for this Llama block with flash attention; equal to the bytes measured on
  CPU). Split over TP ranks as the paper does: attention and MLP tensors t ways; the norms'
  tensors stay whole on every TP rank, unless sequence parallelism splits them too (then all
  of it is /t). For a GPT block the paper's totals are s·b·h·(34 + 5·a·s/h), with TP
  s·b·h·(10 + 24/t + 5·a·s/(h·t)), with TP + SP that /t. With activation checkpointing (full,
  op, selective: notebook 04) add one block's activations, alive while it is recomputed.
  Under 1F1B, stage r of pp holds pp - r micro-batches in flight. CP divides the sequence,
  so activations and logits, by cp.
- logits (our addition): 6·b·s·V bytes on the last stage, bf16 logits and their fp32 copy for
  the loss, /t with loss parallel.
`reserve` is left for what is not counted: CUDA context, FSDP's gathered and prefetched layers,
communication buffers, fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ...distributed.mesh import DIM_NAMES, ParallelDims
from ...efficiency.activation_checkpoint import MODES as AC_MODES
from ...errors import TitanliteError
from ...models.llama import ModelArgs, Transformer
from .activation_memory import activation_memory_estimate
from .zero import PRECISIONS, zero_bytes_per_rank

GB = 1e9


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU: training state (ZeRO's three parts), activations and logits."""

    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.states + self.activations + self.logits

    def __str__(self) -> str:
        return (
            f"{_size(self.total)} = states {_size(self.states)} + activations "
            f"{_size(self.activations)} + logits {_size(self.logits)}"
        )


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.2f} MB"


@dataclass
class Candidate:
    """One layout, its memory (heaviest stage) and why it ranks where it does, or the problem."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int = 1
    ep: int = 1  # dense models only, for now: expert parallelism is planned by hand (notebook 18)
    memory: Memory | None = None
    reasons: list[str] = field(default_factory=list)
    problem: str | None = None  # None: a valid layout that fits

    @property
    def dims(self) -> ParallelDims:
        world = self.pp * self.dp_replicate * self.dp_shard * self.ep * self.cp * self.tp
        return ParallelDims(
            self.dp_replicate, self.dp_shard, world, self.tp, self.pp, self.cp, self.ep
        )

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return self.dims.shape  # the mesh's own order (mesh.py): one place says it

    @property
    def overrides(self) -> dict:
        """Config overrides for `launch` / the CLI (`--parallel.tp 8 ...`)."""
        return {f"parallel.{n}": d for n, d in zip(DIM_NAMES, self.shape)}

    def __str__(self) -> str:
        return self.dims.describe()


@dataclass
class Plan:
    args: ModelArgs
    n_gpus: int
    gpu_mem_bytes: float
    gpus_per_node: int
    usable_bytes: float
    num_params: int
    candidates: list[Candidate]  # valid and fitting, best first
    rejected: list[Candidate]  # with `.problem`

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def report(self, top: int = 3) -> str:
        b, n = self.best, self.num_params
        count = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
        lines = [
            f"{count} parameters on {self.n_gpus} GPUs ({self.gpus_per_node} per node), "
            f"{_size(self.usable_bytes)} usable of {_size(self.gpu_mem_bytes)} each",
            f"→ {b}   (pp, dp_replicate, dp_shard, ep, cp, tp) = {b.shape}",
            *(f"   - {r}" for r in b.reasons),
        ]
        # Why not something simpler: the smallest layout of each simpler (pp, tp) pair that failed.
        simpler = {}
        for c in self.rejected:
            if (c.pp, c.tp) < (b.pp, b.tp) and c.memory is not None:
                if (c.pp, c.tp) not in simpler or c.memory.total < simpler[c.pp, c.tp].memory.total:
                    simpler[c.pp, c.tp] = c
        lines += [
            f"   not {c}: {c.problem}" for c in sorted(simpler.values(), key=lambda c: (c.pp, c.tp))
        ]
        lines += [f"  next: {c}  ({_size(c.memory.total)})" for c in self.candidates[1:top]]
        counts = {}
        for c in self.rejected:
            kind = c.problem.split(":")[0]
            counts[kind] = counts.get(kind, 0) + 1
        lines.append(
            f"  {len(self.candidates)} layouts fit; rejected: "
            + (
                "; ".join(
                    f"{k} × {why}" for why, k in sorted(counts.items(), key=lambda kv: -kv[1])
                )
                or "none"
            )
        )
        return "\n".join(lines)

    def explain(self, top: int = 3) -> None:
        print(self.report(top))


def activation_bytes_per_layer(
    args: ModelArgs,
    seq_len: int,
    micro_batch: int,
    tp: int = 1,
    *,
    sequence_parallel: bool = True,
    checkpointing: str = "none",
    every: int = 2,
) -> float:
    """Saved activations of one layer (the model's average) for one micro-batch on one TP rank,
    bf16 (see the top). `checkpointing`: none | full | op | selective (every `every`-th block)."""
    if checkpointing not in AC_MODES:
        raise TitanliteError(f"checkpointing '{checkpointing}' is not one of {', '.join(AC_MODES)}")

    def estimate(n_layers: int, mode: str = checkpointing) -> int:
        return activation_memory_estimate(
            replace(args, n_layers=n_layers), micro_batch, seq_len, 2, mode, every
        )

    block = estimate(2, "none") - estimate(1, "none")  # one more block: one block's share
    final_norm = estimate(1, "none") - block  # what else estimate() counts; a block has two
    if sequence_parallel or tp == 1:  # everything splits over the TP ranks (the sequence, or heads)
        return (estimate(args.n_layers) - final_norm) / args.n_layers / tp
    if checkpointing == "full":
        return estimate(2) - estimate(1)  # each block keeps its input, whole on every TP rank
    if checkpointing == "none":  # the norms' tensors whole on every TP rank, the rest split
        return 2 * final_norm + (block - 2 * final_norm) / tp
    raise TitanliteError(
        f"checkpointing '{checkpointing}' with TP but without sequence parallelism is not "
        f"modelled: use 'none' or 'full'"
    )


def plan(
    args: ModelArgs | str,
    n_gpus: int,
    gpu_mem_bytes: float,
    *,
    gpus_per_node: int = 8,
    seq_len: int,
    micro_batch: int = 1,
    global_batch: int | None = None,
    precision: str = "mixed",
    checkpointing: str = "none",
    reserve: float = 0.1,
    cp: tuple[int, ...] = (1,),
) -> Plan:
    """Every layout of `n_gpus`, ranked (see the module doc); raises if none can work.
    `global_batch`: sequences per optimizer step (None: no limit on data parallelism).
    `cp`: the context-parallel degrees to consider (long sequences: e.g. (1, 2, 4, 8))."""
    args = ModelArgs.preset(args) if isinstance(args, str) else args
    if n_gpus < 1 or gpus_per_node < 1 or micro_batch < 1 or seq_len < 1 or gpu_mem_bytes <= 0:
        raise TitanliteError(
            f"n_gpus, gpus_per_node, micro_batch, seq_len and gpu_mem_bytes must be "
            f"positive, got {n_gpus}, {gpus_per_node}, {micro_batch}, {seq_len}, "
            f"{gpu_mem_bytes}: pass positive numbers"
        )
    if n_gpus > gpus_per_node and n_gpus % gpus_per_node:
        raise TitanliteError(
            f"{n_gpus} GPUs do not fill whole nodes of {gpus_per_node}: use a multiple of "
            f"{gpus_per_node} GPUs, or set gpus_per_node to what your nodes have"
        )
    if checkpointing not in AC_MODES:
        raise TitanliteError(f"checkpointing '{checkpointing}' is not one of {', '.join(AC_MODES)}")
    if global_batch is not None and global_batch % micro_batch:
        raise TitanliteError(
            f"global_batch={global_batch} is not a multiple of micro_batch={micro_batch}: "
            f"choose a global batch of whole micro-batches"
        )
    usable = (1 - reserve) * gpu_mem_bytes
    divisors = [d for d in range(1, n_gpus + 1) if n_gpus % d == 0]
    fitting, rejected, params, shapes = [], [], {}, _named_shapes(args)
    layouts = [
        (p, t, s, k)
        for p in divisors
        for t in divisors
        for s in divisors
        for k in sorted(set(cp))
        if n_gpus % (p * t * s * k) == 0
    ]
    for pp, tp, dp_shard, cp_degree in layouts:
        c = Candidate(pp, n_gpus // (pp * tp * dp_shard * cp_degree), dp_shard, tp, cp_degree)
        dp = c.dp_replicate * dp_shard
        # Micro-batches per data-parallel rank and step: what the global batch leaves, or 2 per stage.
        m = global_batch // dp // micro_batch if global_batch else (2 * pp if pp > 1 else 1)
        cfg, refused = _trainer_check(c, m, micro_batch, seq_len, args)
        if tp > gpus_per_node or gpus_per_node % tp:
            c.problem = (
                f"TP across nodes: tp={tp} must divide the {gpus_per_node} GPUs of a node "
                f"(TP talks in every layer; only a node's links are fast enough)"
            )
        elif global_batch and (global_batch % (dp * micro_batch) or m < pp):
            c.problem = (
                f"batch too small: global_batch={global_batch} does not give each of the {dp} "
                f"data-parallel ranks whole micro-batches of {micro_batch}"
                + (f", at least pp={pp} of them" if pp > 1 else "")
            )
        else:
            c.problem = refused
        if c.problem is None:
            if (pp, tp) not in params:
                params[pp, tp] = stage_params(args, pp, tp, shapes)
            try:
                c.memory = _heaviest_stage(
                    args, cfg, c, params[pp, tp], seq_len, micro_batch, precision, checkpointing
                )
            except TitanliteError as e:
                c.problem = f"not modelled: {e}"
            if c.memory is not None and c.memory.total > usable:
                c.problem = f"out of memory: needs {c.memory} > {_size(usable)} usable"
        if c.problem is None:
            c.reasons = _reasons(c, args, m, usable, gpus_per_node, precision)
        (rejected if c.problem else fitting).append(c)
    if not fitting:
        closest = min((c for c in rejected if c.memory), key=lambda c: c.memory.total, default=None)
        hint = f"; the smallest, {closest}, needs {closest.memory}" if closest else ""
        raise TitanliteError(
            f"no layout of {n_gpus} GPUs can train this model within {_size(usable)} "
            f"per GPU{hint}: use more GPUs, checkpointing='full', a smaller micro_batch "
            f"or seq_len (plan(...) rejected {len(rejected)} layouts)"
        )

    def crosses_nodes(c: Candidate) -> bool:  # tp is innermost, then cp, then dp_shard (mesh.py)
        return n_gpus > gpus_per_node and c.tp * c.cp * c.dp_shard > gpus_per_node

    # The rules of thumb, in order: no PP, no CP, no TP, DDP when it fits, HSDP over FSDP across nodes.
    fitting.sort(key=lambda c: (c.pp, c.cp, c.tp, c.dp_shard > 1, crosses_nodes(c), -c.dp_shard))
    # named_parameters: a tied weight once
    num_params = sum(math.prod(shape) for _, shape in shapes)
    return Plan(args, n_gpus, gpu_mem_bytes, gpus_per_node, usable, num_params, fitting, rejected)


def _trainer_check(c: Candidate, m: int, micro_batch: int, seq_len: int, args: ModelArgs):
    """The trainer's config for this layout, and what the trainer would refuse about it (TP must
    divide the heads, PP needs a layer per stage, the sequence must cut into 2·cp chunks, ...),
    or None."""
    from ...config import Config
    from ...preflight import check_parallel_config

    cfg = Config()
    cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.pp_microbatches = c.pp, c.tp, m
    cfg.parallel.cp = c.cp
    cfg.training.seq_len, cfg.training.batch_size = seq_len, m * micro_batch
    try:
        check_parallel_config(cfg, c.dims, args)
    except TitanliteError as e:
        return cfg, f"trainer refuses: {e}"
    return cfg, None


def stage_params(args: ModelArgs, pp: int, tp: int, shapes: list | None = None) -> list[int]:
    """Parameters one GPU of each pipeline stage holds before FSDP shards them: the stage's
    matrices split tp ways (TP splits every Linear and the embedding), norm weights whole.
    `shapes`: the model's (name, shape) list, when the caller has it already."""
    from ...distributed.pipeline import split_layers

    layers = split_layers(args.n_layers, pp)
    counts = [0] * pp
    for name, shape in shapes or _named_shapes(args):
        if name.startswith("layers."):
            stage = next(s for s, r in enumerate(layers) if int(name.split(".")[1]) in r)
        else:
            stage = 0 if name.startswith("tok_embeddings") else pp - 1
        counts[stage] += math.prod(shape) // tp if len(shape) == 2 else math.prod(shape)
    return counts


def _named_shapes(args: ModelArgs) -> list[tuple[str, tuple]]:
    with torch.device("meta"):  # counted, never allocated
        return [(n, tuple(p.shape)) for n, p in Transformer(args).named_parameters()]


def _heaviest_stage(
    args, cfg, c: Candidate, params: list[int], seq_len, micro_batch, precision, checkpointing
) -> Memory:
    """Bytes per GPU on the pipeline stage that needs the most (see the module doc)."""
    from ...distributed.parallelize import loss_parallel_enabled, sequence_parallel_enabled
    from ...distributed.pipeline import split_layers

    pp, tp = c.pp, c.tp
    seq_len = seq_len // c.cp  # what a cp rank holds of each sequence
    layers = split_layers(args.n_layers, pp)
    sp = sequence_parallel_enabled(cfg.parallel, c.dims) and tp > 1
    per_layer = activation_bytes_per_layer(
        args, seq_len, micro_batch, tp, sequence_parallel=sp, checkpointing=checkpointing
    )
    recompute = (
        activation_bytes_per_layer(args, seq_len, micro_batch, tp, sequence_parallel=sp)
        if checkpointing != "none"
        else 0
    )  # one block recomputed at a time
    vocab_split = tp if loss_parallel_enabled(cfg.parallel, c.dims) else 1
    stages = []
    for s, n_params in enumerate(params):
        shard = c.dp_shard * c.cp  # FSDP over dp_shard × cp
        z = zero_bytes_per_rank(n_params, shard, 3 if shard > 1 else 0, precision=precision)
        # 1F1B: pp - s micro-batches in flight
        acts = len(layers[s]) * (pp - s) * per_layer + recompute
        logits = 6 * micro_batch * seq_len * args.vocab_size / vocab_split if s == pp - 1 else 0
        stages.append(Memory(z["params"], z["grads"], z["optimizer"], round(acts), round(logits)))
    return max(stages, key=lambda mem: mem.total)


def _reasons(c: Candidate, args, m, usable, gpus_per_node, precision) -> list[str]:
    out = [f"fits: {c.memory} of {_size(usable)} usable"]
    per = sum(PRECISIONS[precision])  # bytes per parameter: weight + gradient + optimizer state
    if c.dp_shard > 1 and c.dp_replicate == 1:
        out.append(
            f"FSDP: parameters, gradients and optimizer state sharded over {c.dp_shard} GPUs "
            f"(ZeRO-3: {per}·Ψ/{c.dp_shard} bytes)"
        )
    elif c.dp_shard > 1:
        where = "one node" if c.tp * c.dp_shard <= gpus_per_node else "several nodes"
        out.append(
            f"HSDP: sharded over {c.dp_shard} GPUs within {where}, {c.dp_replicate} replicas: only "
            f"the gradient all-reduce crosses between replicas"
        )
    elif c.dp_replicate > 1:
        out.append(
            f"DDP: the whole model fits on one GPU, so {c.dp_replicate} full copies; its all-reduce "
            f"moves 2·Ψ per step where ZeRO-3 moves 3·Ψ"
        )
    if c.cp > 1:
        out.append(
            f"CP {c.cp}: each sequence split over {c.cp} GPUs (activations and logits /{c.cp}); "
            f"keys and values travel a ring in every attention layer, FSDP shards over dp_shard × cp"
        )
    if c.tp > 1:
        out.append(
            f"TP {c.tp} within a node ({c.tp} divides the {gpus_per_node} GPUs per node): "
            f"{args.n_heads // c.tp} heads per GPU, its per-layer collectives on fast links"
        )
    if c.pp > 1:
        out.append(
            f"PP {c.pp}: ~{args.n_layers // c.pp} layers per stage; 1F1B bubble (pp-1)/m = "
            f"{(c.pp - 1) / m:.2f} with m={m} micro-batches; only activations cross between stages"
        )
    return out
