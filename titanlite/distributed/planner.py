"""Choosing the degrees: which (pp, dp_replicate, dp_shard, tp) layout to train with, as code.

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
  then TP within a node; PP (across nodes, with its bubble) only when still needed; plain DDP
  when the whole model fits (2Ψ per step on the wire where ZeRO-3 moves 3Ψ); HSDP across nodes
  (shard within a node, replicate across) before FSDP spanning nodes; then the widest shard.

Memory per GPU, in bytes, of the heaviest pipeline stage:
- params / grads / optimizer: ZeRO's formula (zero.py) for Ψ_local, the stage's parameters with
  every matrix split tp ways (norm weights are replicated), sharded dp_shard ways (stage 3;
  stage 0 = DDP when dp_shard = 1). dp_replicate saves nothing: each replica holds it all.
- activations, per transformer layer and micro-batch, 16-bit (Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", §4):
      s·b·h·(34 + 5·a·s/h)                 no TP
      s·b·h·(10 + 24/t + 5·a·s/(h·t))       TP over t ranks
      s·b·h·(34 + 5·a·s/h) / t              TP with sequence parallel
  s: sequence, b: micro-batch, h: dim, a: heads. Flash attention (torch's SDPA) never stores the
  a·s² scores: the 5·a·s/h term drops. Full activation checkpointing keeps each layer's input
  (2·s·b·h, /t with SP) and one layer's activations during its recompute. Under 1F1B, stage r
  of pp holds pp - r micro-batches in flight. The paper counts a GPT block (4h MLP, dropout);
  Llama's SwiGLU block differs: an estimate of the right size, not a measurement.
- logits (our addition): 6·b·s·V bytes on the last stage, bf16 logits and their fp32 copy for
  the loss, /t with loss parallel.
`reserve` is left for what is not counted: CUDA context, FSDP's gathered and prefetched layers,
communication buffers, fragmentation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import TitanliteError
from ..models.llama import ModelArgs, Transformer
from .mesh import DIM_NAMES, ParallelDims
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
        return (f"{_size(self.total)} = states {_size(self.states)} + activations "
                f"{_size(self.activations)} + logits {_size(self.logits)}")


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.2f} MB"


@dataclass
class Candidate:
    """One layout, its memory (heaviest stage) and why it ranks where it does, or the problem."""
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    memory: Memory | None = None
    reasons: list[str] = field(default_factory=list)
    problem: str | None = None  # None: a valid layout that fits

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(self.dp_replicate, self.dp_shard, math.prod(self.shape), self.tp, self.pp)

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
    rejected: list[Candidate]    # with `.problem`

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def report(self, top: int = 3) -> str:
        b, n = self.best, self.num_params
        count = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
        lines = [f"{count} parameters on {self.n_gpus} GPUs ({self.gpus_per_node} per node), "
                 f"{_size(self.usable_bytes)} usable of {_size(self.gpu_mem_bytes)} each",
                 f"→ {b}   (pp, dp_replicate, dp_shard, tp) = {b.shape}", *(f"   - {r}" for r in b.reasons)]
        # Why not something simpler: the smallest layout of each simpler (pp, tp) pair that failed.
        simpler = {}
        for c in self.rejected:
            if (c.pp, c.tp) < (b.pp, b.tp) and c.memory is not None:
                if (c.pp, c.tp) not in simpler or c.memory.total < simpler[c.pp, c.tp].memory.total:
                    simpler[c.pp, c.tp] = c
        lines += [f"   not {c}: {c.problem}" for c in sorted(simpler.values(), key=lambda c: (c.pp, c.tp))]
        lines += [f"  next: {c}  ({_size(c.memory.total)})" for c in self.candidates[1:top]]
        counts = {}
        for c in self.rejected:
            kind = c.problem.split(":")[0]
            counts[kind] = counts.get(kind, 0) + 1
        lines.append(f"  {len(self.candidates)} layouts fit; rejected: " + ("; ".join(
            f"{k} × {why}" for why, k in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"))
        return "\n".join(lines)

    def explain(self, top: int = 3) -> None:
        print(self.report(top))


def activation_bytes_per_layer(args: ModelArgs, seq_len: int, micro_batch: int, tp: int = 1, *,
                               sequence_parallel: bool = True, flash_attention: bool = True,
                               checkpointing: str = "none") -> float:
    """Korthikanti et al. 2022, one layer, one micro-batch, 16-bit activations (see the top)."""
    s, b, h, a = seq_len, micro_batch, args.dim, args.n_heads
    scores = 0.0 if flash_attention else 5 * a * s / h
    sp = sequence_parallel and tp > 1
    if checkpointing == "full":
        return 2 * s * b * h / (tp if sp else 1)
    if checkpointing != "none":
        raise TitanliteError(f"checkpointing '{checkpointing}' is not modelled: use 'none' or 'full'")
    if tp == 1 or sp:
        return s * b * h * (34 + scores) / tp
    return s * b * h * (10 + 24 / tp + scores / tp)


def plan(args: ModelArgs | str, n_gpus: int, gpu_mem_bytes: float, *, gpus_per_node: int = 8,
         seq_len: int, micro_batch: int = 1, global_batch: int | None = None,
         precision: str = "mixed", checkpointing: str = "none", flash_attention: bool = True,
         reserve: float = 0.1) -> Plan:
    """Every layout of `n_gpus`, ranked (see the module doc); raises if none can work.
    `global_batch`: sequences per optimizer step (None: no limit on data parallelism)."""
    args = ModelArgs.preset(args) if isinstance(args, str) else args
    if n_gpus < 1 or gpus_per_node < 1 or micro_batch < 1 or seq_len < 1 or gpu_mem_bytes <= 0:
        raise TitanliteError(f"need positive n_gpus, gpus_per_node, micro_batch, seq_len and memory, got "
                             f"{n_gpus}, {gpus_per_node}, {micro_batch}, {seq_len}, {gpu_mem_bytes}")
    if n_gpus > gpus_per_node and n_gpus % gpus_per_node:
        raise TitanliteError(f"{n_gpus} GPUs do not fill whole nodes of {gpus_per_node}: use a multiple of "
                             f"{gpus_per_node} GPUs, or set gpus_per_node to what your nodes have")
    if global_batch is not None and global_batch % micro_batch:
        raise TitanliteError(f"global_batch={global_batch} is not a multiple of micro_batch={micro_batch}: "
                             f"choose a global batch of whole micro-batches")
    usable = (1 - reserve) * gpu_mem_bytes
    divisors = [d for d in range(1, n_gpus + 1) if n_gpus % d == 0]
    fitting, rejected, params = [], [], {}
    for pp, tp, dp_shard in ((p, t, s) for p in divisors for t in divisors for s in divisors
                             if n_gpus % (p * t * s) == 0):
        c = Candidate(pp, n_gpus // (pp * tp * dp_shard), dp_shard, tp)
        dp = c.dp_replicate * dp_shard
        # Micro-batches per data-parallel rank and step: what the global batch leaves, or 2 per stage.
        m = global_batch // dp // micro_batch if global_batch else (2 * pp if pp > 1 else 1)
        cfg = _trainer_config(pp, tp, m, micro_batch, seq_len)
        if tp > gpus_per_node or gpus_per_node % tp:
            c.problem = (f"TP across nodes: tp={tp} must divide the {gpus_per_node} GPUs of a node "
                         f"(TP talks in every layer; only a node's links are fast enough)")
        elif global_batch and (global_batch % (dp * micro_batch) or m < pp):
            c.problem = (f"batch too small: global_batch={global_batch} does not give each of the {dp} "
                         f"data-parallel ranks whole micro-batches of {micro_batch}"
                         + (f", at least pp={pp} of them" if pp > 1 else ""))
        else:
            c.problem = _trainer_refuses(cfg, c.dims, args)
        if c.problem is None:
            if (pp, tp) not in params:
                params[pp, tp] = stage_params(args, pp, tp)
            c.memory = _heaviest_stage(args, cfg, c, params[pp, tp], seq_len, micro_batch, precision,
                                       checkpointing, flash_attention)
            if c.memory.total > usable:
                c.problem = f"out of memory: needs {c.memory} > {_size(usable)} usable"
        if c.problem is None:
            c.reasons = _reasons(c, args, m, usable, gpus_per_node, precision)
        (rejected if c.problem else fitting).append(c)
    if not fitting:
        closest = min((c for c in rejected if c.memory), key=lambda c: c.memory.total, default=None)
        hint = f"; the smallest, {closest}, needs {closest.memory}" if closest else ""
        raise TitanliteError(f"no layout of {n_gpus} GPUs can train this model within {_size(usable)} "
                             f"per GPU{hint}: use more GPUs, checkpointing='full', a smaller micro_batch "
                             f"or seq_len (plan(...) rejected {len(rejected)} layouts)")

    def crosses_nodes(c: Candidate) -> bool:  # tp is innermost, then dp_shard (mesh.py)
        return n_gpus > gpus_per_node and c.tp * c.dp_shard > gpus_per_node

    # The rules of thumb, in order: no PP, no TP, DDP when it fits, HSDP over FSDP across nodes.
    fitting.sort(key=lambda c: (c.pp, c.tp, c.dp_shard > 1, crosses_nodes(c), -c.dp_shard))
    with torch.device("meta"):
        num_params = Transformer(args).num_params()
    return Plan(args, n_gpus, gpu_mem_bytes, gpus_per_node, usable, num_params, fitting, rejected)


def _trainer_config(pp: int, tp: int, m: int, micro_batch: int, seq_len: int):
    from ..config import Config
    cfg = Config()
    cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.pp_microbatches = pp, tp, m
    cfg.training.seq_len, cfg.training.batch_size = seq_len, m * micro_batch
    return cfg


def _trainer_refuses(cfg, dims: ParallelDims, args: ModelArgs) -> str | None:
    """What titanlite's trainer would refuse (TP divides the heads, a layer per stage, ...)."""
    from .parallelize import check_parallel_config
    try:
        check_parallel_config(cfg, dims, args)
    except TitanliteError as e:
        return f"trainer refuses: {e}"
    return None


def stage_params(args: ModelArgs, pp: int, tp: int) -> list[int]:
    """Parameters one GPU of each pipeline stage holds before FSDP shards them: the stage's
    matrices split tp ways (TP splits every Linear and the embedding), norm weights whole."""
    from .pipeline import split_layers
    layers = split_layers(args.n_layers, pp)
    with torch.device("meta"):  # counted, never allocated
        model = Transformer(args)
    counts = [0] * pp
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            stage = next(s for s, r in enumerate(layers) if int(name.split(".")[1]) in r)
        else:
            stage = 0 if name.startswith("tok_embeddings") else pp - 1
        counts[stage] += p.numel() // tp if p.dim() == 2 else p.numel()
    return counts


def _heaviest_stage(args, cfg, c: Candidate, params: list[int], seq_len, micro_batch, precision,
                    checkpointing, flash_attention) -> Memory:
    """Bytes per GPU on the pipeline stage that needs the most (see the module doc)."""
    from .parallelize import loss_parallel_enabled, sequence_parallel_enabled
    from .pipeline import split_layers
    pp, tp = c.pp, c.tp
    layers = split_layers(args.n_layers, pp)
    sp = sequence_parallel_enabled(cfg, c.dims) and tp > 1
    kw = dict(sequence_parallel=sp, flash_attention=flash_attention)
    per_layer = activation_bytes_per_layer(args, seq_len, micro_batch, tp, checkpointing=checkpointing, **kw)
    recompute = activation_bytes_per_layer(args, seq_len, micro_batch, tp, **kw) if checkpointing == "full" else 0
    vocab_split = tp if loss_parallel_enabled(cfg, c.dims) else 1
    stages = []
    for s, n_params in enumerate(params):
        z = zero_bytes_per_rank(n_params, c.dp_shard, 3 if c.dp_shard > 1 else 0, precision=precision)
        acts = len(layers[s]) * (pp - s) * per_layer + recompute  # 1F1B: pp - s micro-batches in flight
        logits = 6 * micro_batch * seq_len * args.vocab_size / vocab_split if s == pp - 1 else 0
        stages.append(Memory(z["params"], z["grads"], z["optimizer"], round(acts), round(logits)))
    return max(stages, key=lambda mem: mem.total)


def _reasons(c: Candidate, args, m, usable, gpus_per_node, precision) -> list[str]:
    out = [f"fits: {c.memory} of {_size(usable)} usable"]
    per = sum(PRECISIONS[precision])  # bytes per parameter: weight + gradient + optimizer state
    if c.dp_shard > 1 and c.dp_replicate == 1:
        out.append(f"FSDP: parameters, gradients and optimizer state sharded over {c.dp_shard} GPUs "
                   f"(ZeRO-3: {per}·Ψ/{c.dp_shard} bytes)")
    elif c.dp_shard > 1:
        where = "one node" if c.tp * c.dp_shard <= gpus_per_node else "several nodes"
        out.append(f"HSDP: sharded over {c.dp_shard} GPUs within {where}, {c.dp_replicate} replicas: only "
                   f"the gradient all-reduce crosses between replicas")
    elif c.dp_replicate > 1:
        out.append(f"DDP: the whole model fits on one GPU, so {c.dp_replicate} full copies; its all-reduce "
                   f"moves 2·Ψ per step where ZeRO-3 moves 3·Ψ")
    if c.tp > 1:
        out.append(f"TP {c.tp} within a node ({c.tp} divides the {gpus_per_node} GPUs per node): "
                   f"{args.n_heads // c.tp} heads per GPU, its per-layer collectives on fast links")
    if c.pp > 1:
        out.append(f"PP {c.pp}: ~{args.n_layers // c.pp} layers per stage; 1F1B bubble (pp-1)/m = "
                   f"{(c.pp - 1) / m:.2f} with m={m} micro-batches; only activations cross between stages")
    return out


def inspect_layout(pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, *,
                   device: str = "cpu", model: dict | None = None) -> dict:
    """Run in every rank of a launched job (`launch_function`): build the trainer's DeviceMesh
    and its model parts (`parallelize`, the trainer's own chain) for this layout, and report
    what this rank really has: its mesh coordinates, for each dim the ranks of its process
    group as torch holds them and the ranks that answered an all-gather over it, and how many
    parameter elements it stores (its DTensor shards), to hold against `stage_params`."""
    import torch.distributed as dist

    from ..config import Config
    from .env import init_distributed
    from .parallelize import parallelize
    env = init_distributed(device)
    dims = ParallelDims.resolve(dp_replicate, dp_shard, env.world_size, tp=tp, pp=pp)
    mesh = dims.build_mesh(env.device.type)
    out = {"rank": env.rank, "coordinates": {n: mesh.get_local_rank(n) for n in DIM_NAMES}}
    for n in DIM_NAMES:
        group = mesh.get_group(n)
        answered = [torch.zeros(1, dtype=torch.long, device=env.device) for _ in range(mesh[n].size())]
        dist.all_gather(answered, torch.tensor([env.rank], device=env.device), group=group)
        out[n] = {"mesh": mesh[n].mesh.tolist(), "group": dist.get_process_group_ranks(group),
                  "answered": [int(t) for t in answered]}
    cfg = Config()
    cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.dp_shard, cfg.parallel.dp_replicate = pp, tp, dp_shard, dp_replicate
    cfg.parallel.pp_microbatches, cfg.training.batch_size = pp, pp
    args = ModelArgs.preset("debug", **(model or {}))
    parts, _ = parallelize(args, cfg, env, dims, mesh, torch.float32)
    out["param_elements"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                                for part in parts for p in part.parameters())
    return out
