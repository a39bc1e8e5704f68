"""Checks for notebooks 07-11: DDP buckets, ZeRO/FSDP bytes, tensor-parallel MLP, 1F1B, the 4-D
rank grid. Ranks are simulated in one process (lists indexed by rank): the arithmetic is the
technique's, and the check stays fast enough for a lab.

Where a random draw could miss the case that tells a classic mistake apart, the check draws
until every mistake listed beside it answers differently (`Check.separating`)."""

from __future__ import annotations

import math
import random

import torch

from .grading import exercise

_SHORT = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _which(tensors, found) -> list[list[int]]:
    index = {id(t): i for i, t in enumerate(tensors)}
    return [[index.get(id(t), -1) for t in bucket] for bucket in found]


# Classic bucketing mistakes, as tensor indices (the checks' inputs always tell them apart).
def _ignore_dtype(params, cap):  # one open bucket for every dtype
    buckets, current = [], []
    for i in range(len(params)):
        current.append(i)
        if _bytes([params[j] for j in current]) >= cap:
            buckets.append(current)
            current = []
    return buckets + ([current] if current else [])


def _by_dtype(params, cap, *, strict=False, before=False, open_first=False):
    closed, open_buckets = [], {}
    for i, p in enumerate(params):
        bucket = open_buckets.setdefault(p.dtype, [])
        if before:  # a new bucket when this tensor would take the open one past the cap
            if bucket and _bytes([params[j] for j in bucket]) + _bytes([p]) > cap:
                closed.append(open_buckets.pop(p.dtype))
                bucket = open_buckets.setdefault(p.dtype, [])
            bucket.append(i)
            continue
        bucket.append(i)
        size = _bytes([params[j] for j in bucket])
        if size > cap or (size == cap and not strict):
            closed.append(open_buckets.pop(p.dtype))
    return (
        (list(open_buckets.values()) + closed)
        if open_first
        else closed + list(open_buckets.values())
    )


BUCKET_MISTAKES = {
    "one bucket for all dtypes": _ignore_dtype,
    "closing only above the cap": lambda ps, cap: _by_dtype(ps, cap, strict=True),
    "closing before the cap is reached": lambda ps, cap: _by_dtype(ps, cap, before=True),
    "the open buckets first": lambda ps, cap: _by_dtype(ps, cap, open_first=True),
    "one bucket": lambda ps, cap: [list(range(len(ps)))],
    "one tensor per bucket": lambda ps, cap: [[i] for i in range(len(ps))],
}


def _draw_buckets(rng: random.Random):
    cases = []
    for i in range(3):
        n = rng.randint(4, 12)
        dtypes = [rng.choice([torch.float32, torch.float32, torch.bfloat16]) for _ in range(n)]
        dtypes[rng.randrange(n)], dtypes[rng.randrange(n)] = (
            torch.bfloat16,
            torch.float32,
        )  # both, mixed
        params = [torch.zeros(rng.randint(1, 64), rng.randint(1, 64), dtype=d) for d in dtypes]
        f32 = [p for p in params if p.dtype == torch.float32]
        # The first case's cap is reached exactly (by its first two float32 tensors): >= vs >.
        cap = _bytes(f32[:2]) if i == 0 and len(f32) > 2 else rng.choice([256, 1024, 4096, 16384])
        cases.append((params, cap))
    return cases


@exercise("07_buckets", "DDP's bucket assignment")
def buckets(c, fn):
    from ..nb07_scratch_ddp import assign_buckets

    cases = c.separating(
        _draw_buckets, lambda ps, cap: _which(ps, assign_buckets(ps, cap)), BUCKET_MISTAKES
    )
    for params, cap in cases:
        got = c.call(fn, list(params), cap)
        if not isinstance(got, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in got):
            c.fail(
                f"return a list of buckets (lists of the tensors given), got {type(got).__name__}"
            )
        got_i, want_i = _which(params, got), _which(params, assign_buckets(params, cap))
        if got_i != want_i:
            where = next(
                (i for i, (a, b) in enumerate(zip(got_i, want_i)) if a != b),
                min(len(got_i), len(want_i)),
            )
            sizes = " ".join(
                f"{i}:{p.numel() * p.element_size()}B/{_SHORT[p.dtype]}"
                for i, p in enumerate(params)
            )
            c.fail(
                f"with cap {cap:,} B and tensors (index:bytes/dtype) {sizes}: bucket {where} is "
                f"{got_i[where] if where < len(got_i) else 'missing'}, expected "
                f"{want_i[where] if where < len(want_i) else 'no more buckets'} (all: {want_i})"
            )
    c.passed("the same buckets as titanlite.labs.nb07_scratch_ddp.assign_buckets")


@exercise("07_bucketed_allreduce", "average gradients over ranks, one collective per bucket")
def bucketed_allreduce(c, fn):
    from ..nb07_scratch_ddp import assign_buckets

    rng = c.rng
    while True:  # at least two buckets, and one holding several tensors: counting per tensor fails
        world, cap = rng.randint(2, 4), rng.choice([512, 2048, 8192])
        shapes = [(rng.randint(1, 40), rng.randint(1, 40)) for _ in range(rng.randint(3, 9))]
        found = assign_buckets([torch.zeros(s) for s in shapes], cap)
        if len(found) >= 2 and max(len(b) for b in found) >= 2:
            break
    grads = [[torch.randn(s, generator=c.gen) for s in shapes] for _ in range(world)]
    got = c.call(fn, [[t.clone() for t in rank] for rank in grads], cap)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        c.fail(f"return (averaged_grads, n_collectives), got {type(got).__name__}")
    averaged, collectives = got
    if not isinstance(averaged, (list, tuple)) or len(averaged) != len(shapes):
        c.fail(
            f"return one averaged gradient per parameter ({len(shapes)}), got "
            f"{len(averaged) if isinstance(averaged, (list, tuple)) else type(averaged).__name__}"
        )
    for i in range(len(shapes)):
        want = torch.stack([rank[i] for rank in grads]).mean(0)
        c.same_tensor(
            averaged[i],
            want,
            f"gradient {i} (shape {shapes[i]}) averaged over {world} ranks",
            rtol=1e-5,
        )
    sizes = [s[0] * s[1] * 4 for s in shapes]
    c.same_value(
        collectives,
        len(found),
        f"the number of all-reduces for {len(shapes)} tensors of "
        f"{sizes} B and a {cap:,} B cap (one per bucket)",
    )
    c.passed(f"the mean over {world} ranks, in {len(found)} collectives as DDP's buckets")


@exercise("08_zero_bytes", "bytes per rank at ZeRO stage 0-3 (fp32 Adam)")
def zero_bytes(c, fn):
    from ...tools.predict.zero import zero_bytes_per_rank

    rng = c.rng
    cases = []
    for stage in (
        0,
        1,
        2,
        3,
        0,
        1,
        2,
        3,
    ):  # every stage on several ranks, with a remainder: ceil, not floor
        world = rng.choice([3, 8, 64])
        cases.append(
            (rng.randint(1, 10**9 // world) * world + rng.randint(1, world - 1), world, stage)
        )
    cases += [
        (rng.randint(1, 10**9), rng.choice([1, 2, 3, 8, 64]), rng.randint(0, 3)) for _ in range(4)
    ]
    rng.shuffle(cases)
    for n, world, stage in cases:
        real = zero_bytes_per_rank(n, world, stage)
        c.same_value(
            c.call(fn, n, world, stage),
            {k: real[k] for k in ("params", "grads", "optimizer")},
            f"zero_bytes({n:,} parameters, world_size={world}, stage={stage})",
        )
    c.passed(
        f"equals titanlite.tools.predict.zero.zero_bytes_per_rank on {len(cases)} random cases"
    )


def _array_split(shape, world, rank):
    base, extra = divmod(shape[0], world)
    return (base + (rank < extra)) * math.prod(shape[1:])


def _last_takes_rest(shape, world, rank):
    rows = shape[0] // world
    return (shape[0] - rows * (world - 1) if rank == world - 1 else rows) * math.prod(shape[1:])


SHARD_MISTAKES = {
    "numel // world": lambda shape, w, r: math.prod(shape) // w,
    "ceil(numel / world)": lambda shape, w, r: math.ceil(math.prod(shape) / w),
    "numpy.array_split's rows": _array_split,
    "the last rank takes the rest": _last_takes_rest,
    "the padded shard on every rank": lambda shape, w, r: (
        math.ceil(shape[0] / w) * math.prod(shape[1:])
    ),
}


def _draw_shards(rng: random.Random):
    pairs = [
        (tuple(rng.randint(1, 33) for _ in range(rng.randint(1, 3))), rng.randint(1, 9))
        for _ in range(14)
    ]
    world = rng.randint(3, 8)  # and one where the last ranks own nothing: d0 = world + 1
    pairs.append(((world + 1, rng.randint(2, 9)), world))
    rng.shuffle(pairs)
    return [(shape, world, rank) for shape, world in pairs for rank in range(world)]


@exercise("08_fsdp_shard", "elements of a parameter FSDP2 keeps on a rank")
def fsdp_shard(c, fn):
    from ...tools.predict.zero import fsdp_shard_numel

    cases = c.separating(_draw_shards, fsdp_shard_numel, SHARD_MISTAKES)
    for shape, world, rank in cases:
        c.same_value(
            c.call(fn, shape, world, rank),
            fsdp_shard_numel(shape, world, rank),
            f"shard_numel(shape={shape}, world_size={world}, rank={rank})",
        )
    c.passed("equals titanlite.tools.predict.zero.fsdp_shard_numel, rank by rank")


@exercise("09_tp_mlp", "a column-parallel then row-parallel SwiGLU MLP")
def tp_mlp(c, fn):
    from ...models.layers import FeedForward

    tp = c.rng.choice([2, 4])
    with (
        torch.random.fork_rng()
    ):  # the model's init draws from the global generator: not the student's
        torch.manual_seed(c.seed)
        full = FeedForward(16, 8 * tp)  # dim 16, 8·tp hidden units
    x = torch.randn(2, 5, 16, generator=c.gen)
    partials = []
    h = full.gate_proj.out_features
    for rank in range(tp):
        got = c.call(
            fn,
            full.gate_proj.weight.detach().clone(),
            full.up_proj.weight.detach().clone(),
            full.down_proj.weight.detach().clone(),
            tp,
            rank,
        )
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            c.fail(f"return (gate_shard, up_shard, down_shard), got {type(got).__name__}")
        gate, up, down = got
        rows = slice(rank * h // tp, (rank + 1) * h // tp)  # ScratchParallelMLP's split
        c.same_tensor(
            gate,
            full.gate_proj.weight[rows].detach(),
            f"rank {rank}'s gate shard "
            f"(column-parallel: rows {rows.start}:{rows.stop} of the [{h}, 16] weight)",
        )
        c.same_tensor(
            up,
            full.up_proj.weight[rows].detach(),
            f"rank {rank}'s up shard (rows {rows.start}:{rows.stop} of the [{h}, 16] weight)",
        )
        c.same_tensor(
            down,
            full.down_proj.weight[:, rows].detach(),
            f"rank {rank}'s down shard "
            f"(row-parallel: columns {rows.start}:{rows.stop} of the [16, {h}] weight)",
        )
        partials.append((torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T)
    c.same_tensor(sum(partials), full(x).detach(), "the all-reduced output", rtol=1e-4, atol=1e-5)
    c.passed(f"{tp} shards whose partial sums (one all-reduce) equal the full MLP")


@exercise("10_one_f_one_b", "the 1F1B order of rank r for p stages and m micro-batches")
def one_f_one_b(c, fn):
    from ...tools.display.pipeline_timeline import one_f_one_b_order

    for p in (2, 3, 4):
        for m in (1, p - 1, p, 2 * p + 1):
            for rank in range(p):
                got = c.call(fn, rank, p, m)
                got = (
                    [tuple(op) if isinstance(op, (list, tuple)) else op for op in got]
                    if isinstance(got, (list, tuple))
                    else got
                )
                want = one_f_one_b_order(rank, p, m)
                if not isinstance(got, list):
                    c.fail(f"return a list of ('F', i) and ('B', i), got {type(got).__name__}")
                if got != want:
                    where = next(
                        (i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                        min(len(got), len(want)),
                    )
                    c.fail(
                        f"rank {rank} of p={p}, m={m}: op {where} is "
                        f"{got[where] if where < len(got) else 'missing'}, expected "
                        f"{want[where] if where < len(want) else 'nothing more'} (full: {want})"
                    )
    c.passed("the same order as titanlite.tools.display.pipeline_timeline for every rank")


@exercise("10_bubble", "the 1F1B bubble fraction")
def bubble(c, fn):
    from ...tools.display.pipeline_timeline import formula_bubble

    cases = [(2, 4), (4, 4), (4, 16), (8, 3)] + [
        (c.rng.randint(2, 16), c.rng.randint(1, 64)) for _ in range(4)
    ]
    for p, m in cases:
        c.same_value(c.call(fn, p, m), formula_bubble("1f1b", p, m), f"the bubble for p={p}, m={m}")
    c.passed("(p-1)/m, as formula_bubble")


def _random_dims(rng: random.Random):
    from ...distributed.mesh import ParallelDims

    pp, rep, shard, cp, tp = (rng.choice([1, 2, 3]) for _ in range(5))
    ep = rng.choice([1, 2])  # 1 or 2 keeps the grids small enough to check every rank
    world = pp * rep * shard * ep * cp * tp
    return ParallelDims(rep, shard, world, tp=tp, pp=pp, cp=cp, ep=ep)


def _dims_of(shape):
    from ...distributed.mesh import ParallelDims

    pp, rep, shard, ep, cp, tp = shape
    return ParallelDims(rep, shard, math.prod(shape), tp=tp, pp=pp, cp=cp, ep=ep)


def _unravel(rank, sizes):
    out = []
    for size in reversed(sizes):
        out.append(rank % size)
        rank //= size
    return out[::-1]


_AXES = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
GRID_MISTAKES = {
    "pp varying fastest": lambda rank, shape: dict(zip(_AXES, _unravel(rank, shape[::-1])[::-1])),
    "dp_replicate and dp_shard swapped": lambda rank, shape: dict(
        zip(("pp", "dp_shard", "dp_replicate", "ep", "cp", "tp"), _unravel(rank, shape))
    ),
    "cp and tp swapped": lambda rank, shape: dict(
        zip(("pp", "dp_replicate", "dp_shard", "ep", "tp", "cp"), _unravel(rank, shape))
    ),
    "ep and cp swapped": lambda rank, shape: dict(
        zip(("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp"), _unravel(rank, shape))
    ),
    "sizes read in reverse": lambda rank, shape: dict(zip(_AXES, _unravel(rank, shape[::-1]))),
}


def _draw_grids(rng: random.Random):
    return [
        (rank, dims.shape)
        for dims in (_random_dims(rng) for _ in range(4))
        for rank in range(dims.world_size)
    ]


@exercise(
    "11_rank_grid", "a rank's coordinates in the (pp, dp_replicate, dp_shard, ep, cp, tp) grid"
)
def rank_grid(c, fn):
    def real(rank, shape):
        return _dims_of(shape).coordinates(rank)

    cases = c.separating(_draw_grids, real, GRID_MISTAKES)
    for rank, shape in cases:
        c.same_value(
            c.call(fn, rank, shape),
            real(rank, shape),
            f"the coordinates of rank {rank} in a grid of shape {shape}",
        )
    c.passed(
        f"equals ParallelDims.coordinates for every rank of {len({s for _, s in cases})} random grids"
    )


def _sorted_groups(groups):
    return sorted(sorted(int(r) for r in g) for g in groups)


def _groups_along(shape, axis):
    grid = torch.arange(math.prod(shape)).view(shape).movedim(axis, -1)
    return grid.reshape(-1, shape[axis]).tolist()


GROUP_MISTAKES = {
    "the axis counted from the end": lambda shape, dim: _sorted_groups(
        _groups_along(shape, len(_AXES) - 1 - _AXES.index(dim))
    ),
    "consecutive ranks, whatever the dim": lambda shape, dim: _sorted_groups(
        torch.arange(math.prod(shape)).view(-1, shape[_AXES.index(dim)]).tolist()
    ),
    "the ranks sharing this coordinate": lambda shape, dim: _sorted_groups(
        torch.arange(math.prod(shape))
        .view(shape)
        .movedim(_AXES.index(dim), 0)
        .reshape(shape[_AXES.index(dim)], -1)
        .tolist()
    ),
}


def _draw_group_cases(rng: random.Random):
    from ...distributed.mesh import DIM_NAMES

    return [
        (dims.shape, dim) for dims in (_random_dims(rng) for _ in range(4)) for dim in DIM_NAMES
    ]


@exercise("11_groups", "the process groups along one dim of the grid")
def groups(c, fn):
    def real(shape, dim):
        return sorted(_dims_of(shape).groups(dim))

    cases = c.separating(_draw_group_cases, real, GROUP_MISTAKES)
    for shape, dim in cases:
        got = c.call(fn, shape, dim)
        try:
            got = _sorted_groups(got)
        except (TypeError, ValueError):
            c.fail(
                f"return a list of lists of ranks for the '{dim}' groups of shape {shape}, got {got!r}"
            )
        c.same_value(got, real(shape, dim), f"the '{dim}' groups of shape {shape} (sorted)")
    c.passed(
        f"equals ParallelDims.groups for every dim of {len({s for s, _ in cases})} random grids"
    )


@exercise("09_block_comm", "bytes one transformer block's forward communicates under TP")
def block_comm(c, fn):
    from ...models.llama import ModelArgs
    from ..nb09_tensor_parallel import tp_comm_formula

    rng = c.rng
    for sp in (False, True, False, True, False, True):
        batch, seq, dim = rng.randint(1, 8), rng.randint(1, 512), rng.choice([64, 256, 4096])
        want = {
            op: row["bytes"]
            for op, row in tp_comm_formula(ModelArgs(dim=dim), batch, seq, 2, sequence_parallel=sp)[
                "per_block"
            ]["forward"].items()
        }
        c.same_value(
            c.call(fn, batch, seq, dim, sp),
            want,
            f"block_forward_comm(batch={batch}, seq={seq}, dim={dim}, sequence_parallel={sp})",
        )
    c.passed("the bytes tp_comm_formula predicts, which notebook 09 counted on real collectives")
