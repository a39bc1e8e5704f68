"""Checks for notebooks 07-11: DDP buckets, ZeRO/FSDP bytes, tensor-parallel MLP, 1F1B, the 4-D
rank grid. Ranks are simulated in one process (lists indexed by rank): the arithmetic is the
technique's, and the check stays fast enough for a lab."""
from __future__ import annotations

import random

import torch

from ...exercises import call, fail, fresh_seed, passed, same_tensor, same_value
from . import exercise


def _random_params(rng: random.Random, n: int) -> list[torch.Tensor]:
    shapes = [(rng.randint(1, 64), rng.randint(1, 64)) for _ in range(n)]
    return [torch.zeros(s, dtype=rng.choice([torch.float32, torch.float32, torch.bfloat16])) for s in shapes]


def _which(tensors, found) -> list[list[int]]:
    index = {id(t): i for i, t in enumerate(tensors)}
    return [[index.get(id(t), -1) for t in bucket] for bucket in found]


@exercise("07_buckets", "DDP's bucket assignment")
def buckets(fn):
    from ...distributed.scratch_ddp import assign_buckets
    name, seed = "07_buckets", fresh_seed()
    rng = random.Random(seed)
    for _ in range(3):
        params, cap = _random_params(rng, rng.randint(3, 12)), rng.choice([256, 1024, 4096, 16384])
        got = call(name, fn, list(params), cap)
        if not isinstance(got, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in got):
            fail(name, f"return a list of buckets (lists of the tensors given), got {type(got).__name__}", seed)
        got_i, want_i = _which(params, got), _which(params, assign_buckets(params, cap))
        same_value(name, got_i, want_i, f"the buckets (as tensor indices) for cap {cap} B and sizes "
                   f"{[p.numel() * p.element_size() for p in params]}", seed=seed)
    return passed(name, "the same buckets as titanlite.distributed.scratch_ddp.assign_buckets")


@exercise("07_bucketed_allreduce", "average gradients over ranks, one collective per bucket")
def bucketed_allreduce(fn):
    from ...distributed.scratch_ddp import assign_buckets
    name, seed = "07_bucketed_allreduce", fresh_seed()
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    world, cap = rng.randint(2, 4), rng.choice([512, 2048, 8192])
    shapes = [(rng.randint(1, 40), rng.randint(1, 40)) for _ in range(rng.randint(3, 9))]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(world)]
    got = call(name, fn, [[t.clone() for t in rank] for rank in grads], cap)
    if not isinstance(got, tuple) or len(got) != 2:
        fail(name, f"return (averaged_grads, n_collectives), got {type(got).__name__}", seed)
    averaged, collectives = got
    if not isinstance(averaged, (list, tuple)) or len(averaged) != len(shapes):
        fail(name, f"return one averaged gradient per parameter ({len(shapes)})", seed)
    for i in range(len(shapes)):
        want = torch.stack([rank[i] for rank in grads]).mean(0)
        same_tensor(name, averaged[i], want, f"gradient {i} (shape {shapes[i]}) averaged over {world} ranks",
                    seed=seed, rtol=1e-5)
    n_buckets = len(assign_buckets(grads[0], cap))
    same_value(name, collectives, n_buckets, f"the number of all-reduces for {len(shapes)} tensors and a "
               f"{cap} B cap (one per bucket)", seed=seed)
    return passed(name, f"the mean over {world} ranks, in {n_buckets} collectives as DDP's buckets")


@exercise("08_zero_bytes", "bytes per rank at ZeRO stage 0-3 (fp32 Adam)")
def zero_bytes(fn):
    from ...distributed.zero import zero_bytes_per_rank
    name, seed = "08_zero_bytes", fresh_seed()
    rng = random.Random(seed)
    for _ in range(12):
        n, world, stage = rng.randint(1, 10**9), rng.choice([1, 2, 3, 8, 64]), rng.randint(0, 3)
        want = zero_bytes_per_rank(n, world, stage)
        got = call(name, fn, n, world, stage)
        if not isinstance(got, dict):
            fail(name, f"return a dict with params, grads and optimizer, got {type(got).__name__}", seed)
        for part in ("params", "grads", "optimizer"):
            same_value(name, got.get(part), want[part], f"{part} bytes for {n:,} parameters, "
                       f"{world} ranks, stage {stage}", seed=seed)
    return passed(name, "equals titanlite.distributed.zero.zero_bytes_per_rank on 12 random cases")


@exercise("08_fsdp_shard", "elements of a parameter FSDP2 keeps on a rank")
def fsdp_shard(fn):
    from ...distributed.zero import fsdp_shard_numel
    name, seed = "08_fsdp_shard", fresh_seed()
    rng = random.Random(seed)
    for _ in range(15):
        shape = tuple(rng.randint(1, 33) for _ in range(rng.randint(1, 3)))
        world = rng.randint(1, 9)
        for rank in range(world):
            same_value(name, call(name, fn, shape, world, rank), fsdp_shard_numel(shape, world, rank),
                       f"rank {rank} of {world} for shape {shape}", seed=seed)
    return passed(name, "equals titanlite.distributed.zero.fsdp_shard_numel, rank by rank")


@exercise("09_tp_mlp", "a column-parallel then row-parallel SwiGLU MLP")
def tp_mlp(fn):
    from ...models.llama import FeedForward, ModelArgs
    name, seed = "09_tp_mlp", fresh_seed()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tp = rng.choice([2, 4])
    full = FeedForward(ModelArgs(dim=16, ffn_hidden_dim=8 * tp, n_heads=2, n_kv_heads=1))
    x = torch.randn(2, 5, 16)
    partials = []
    h = full.gate_proj.out_features
    for rank in range(tp):
        got = call(name, fn, full.gate_proj.weight.detach().clone(), full.up_proj.weight.detach().clone(),
                   full.down_proj.weight.detach().clone(), tp, rank)
        if not isinstance(got, tuple) or len(got) != 3:
            fail(name, f"return (gate_shard, up_shard, down_shard), got {type(got).__name__}", seed)
        gate, up, down = got
        rows = slice(rank * h // tp, (rank + 1) * h // tp)  # ScratchParallelMLP's split
        same_tensor(name, gate, full.gate_proj.weight[rows].detach(), f"rank {rank}'s gate shard "
                    f"(column-parallel: rows {rows.start}:{rows.stop} of the [{h}, 16] weight)", seed=seed)
        same_tensor(name, up, full.up_proj.weight[rows].detach(), f"rank {rank}'s up shard", seed=seed)
        same_tensor(name, down, full.down_proj.weight[:, rows].detach(), f"rank {rank}'s down shard "
                    f"(row-parallel: columns {rows.start}:{rows.stop} of the [16, {h}] weight)", seed=seed)
        partials.append((torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T)
    same_tensor(name, sum(partials), full(x).detach(), "the all-reduced output", seed=seed, rtol=1e-4, atol=1e-5)
    return passed(name, f"{tp} shards whose partial sums (one all-reduce) equal the full MLP")


@exercise("10_one_f_one_b", "the 1F1B order of rank r for p stages and m micro-batches")
def one_f_one_b(fn):
    from ...distributed.pipeline_timeline import one_f_one_b_order
    name = "10_one_f_one_b"
    for p in (2, 3, 4):
        for m in (1, p - 1, p, 2 * p + 1):
            for rank in range(p):
                got = call(name, fn, rank, p, m)
                got = [tuple(op) for op in got] if isinstance(got, (list, tuple)) else got
                want = one_f_one_b_order(rank, p, m)
                if got != want:
                    where = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    fail(name, f"rank {rank} of p={p}, m={m}: op {where} is "
                               f"{got[where] if where < len(got) else 'missing'}, expected "
                               f"{want[where] if where < len(want) else 'nothing more'} (full: {want})")
    return passed(name, "the same order as titanlite.distributed.pipeline_timeline for every rank")


@exercise("10_bubble", "the 1F1B bubble fraction")
def bubble(fn):
    from ...distributed.pipeline_timeline import formula_bubble
    name = "10_bubble"
    for p, m in ((2, 4), (4, 4), (4, 16), (8, 3)):
        same_value(name, call(name, fn, p, m), formula_bubble("1f1b", p, m), f"the bubble for p={p}, m={m}")
    return passed(name, "(p-1)/m, as formula_bubble")


def _random_dims(rng: random.Random):
    from ...distributed.mesh import ParallelDims
    pp, rep, shard, tp = (rng.choice([1, 2, 3]) for _ in range(4))
    return ParallelDims(dp_replicate=rep, dp_shard=shard, world_size=pp * rep * shard * tp, tp=tp, pp=pp)


@exercise("11_rank_grid", "a rank's coordinates in the (pp, dp_replicate, dp_shard, tp) grid")
def rank_grid(fn):
    name, seed = "11_rank_grid", fresh_seed()
    rng = random.Random(seed)
    for _ in range(4):
        dims = _random_dims(rng)
        for rank in range(dims.world_size):
            same_value(name, call(name, fn, rank, dims.shape), dims.coordinates(rank),
                       f"the coordinates of rank {rank} in a grid of shape {dims.shape}", seed=seed)
    return passed(name, "equals ParallelDims.coordinates for every rank of 4 random grids")


@exercise("11_groups", "the process groups along one dim of the grid")
def groups(fn):
    from ...distributed.mesh import DIM_NAMES
    name, seed = "11_groups", fresh_seed()
    rng = random.Random(seed)
    for _ in range(4):
        dims = _random_dims(rng)
        for dim in DIM_NAMES:
            got = call(name, fn, dims.shape, dim)
            got = sorted(sorted(int(r) for r in group) for group in got) if isinstance(got, (list, tuple)) else got
            same_value(name, got, sorted(dims.groups(dim)), f"the '{dim}' groups of shape {dims.shape}", seed=seed)
    return passed(name, "equals ParallelDims.groups for every dim of 4 random grids")


@exercise("09_block_comm", "bytes one transformer block's forward communicates under TP")
def block_comm(fn):
    from ...models.llama import ModelArgs
    from ..nb09_tensor_parallel import tp_comm_formula
    name, seed = "09_block_comm", fresh_seed()
    rng = random.Random(seed)
    for sp in (False, True, False, True, False, True):
        batch, seq, dim = rng.randint(1, 8), rng.randint(1, 512), rng.choice([64, 256, 4096])
        want = {op: row["bytes"] for op, row in tp_comm_formula(
            ModelArgs(dim=dim), batch, seq, 2, sequence_parallel=sp)["per_block"]["forward"].items()}
        got = call(name, fn, batch, seq, dim, sp)
        same_value(name, got, want, f"the forward collectives of one block (batch {batch}, seq {seq}, dim {dim}, "
                   f"sequence_parallel={sp}, fp32 activations)", seed=seed)
    return passed(name, "the bytes tp_comm_formula predicts, which notebook 09 counted on real collectives")
