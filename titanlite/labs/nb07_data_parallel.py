"""Notebook 07's experiments, run inside every rank: data parallelism by hand against torch's
DDP, what `no_sync` saves during gradient accumulation, and what share of a step the
all-reduce takes.

The caller started the ranks (torchrun, or titanlite's launcher) and joined the process group.
Each function builds the same tiny Llama on every rank, feeds each rank its own random tokens
and returns a plain, picklable dict:

    scratch_vs_ddp()          ScratchDataParallel and apply_ddp side by side, step by step
    accumulation_traffic()    all-reduce rounds and bytes of one accumulated step, ± no_sync
    allreduce_share()         forward+backward with and without the all-reduce, and alone

    run_several(scratch_vs_ddp={}, accumulation_traffic={"accum": 4})   # both, in one job
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist

from ..distributed.ddp import apply_ddp, grad_sync
from ..errors import TitanliteError
from ..hardware import synchronize
from ..models.llama import ModelArgs
from ..tools.jobs.run_function import report
from ..tools.measure.comm import CommCounter
from ._common import join, next_token_loss, random_tokens, seeded_model
from .nb07_scratch_ddp import ScratchDataParallel, allreduce_mean_


def _batch(args: ModelArgs, batch_size: int, seq_len: int, device, *key: int):
    """Tokens and next tokens that depend only on `key` (seed, step, rank, micro-batch)."""
    seed = sum(k * 1_000_003**i for i, k in enumerate(key)) % 2**62
    tokens = random_tokens(args.vocab_size, (batch_size, seq_len + 1), seed, device)
    return tokens[:, :-1], tokens[:, 1:]


def _all_reduce_bytes(counter: CommCounter) -> list[int]:
    return [e.bytes for e in counter.events if e.op == "all_reduce"]


def _max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest difference of any tensor pair, relative to that tensor's largest entry."""
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


@torch.no_grad()
def _equal_to_first_rank(model) -> bool:
    """True on every rank when every parameter equals rank 0's bit for bit."""
    same = all(torch.equal(p, _from_first_rank(p)) for p in model.parameters())
    flag = torch.tensor([1.0 if same else 0.0], device=next(model.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _from_first_rank(t: torch.Tensor) -> torch.Tensor:
    copy_ = t.detach().clone()
    dist.broadcast(copy_, src=0)
    return copy_


def _clock(device) -> float:
    synchronize(device)  # kernels run asynchronously: wait before reading time
    return time.perf_counter()


# ----- the experiments -------------------------------------------------------------------------


def scratch_vs_ddp(
    bucket_caps_mb=(25.0, 0.25),
    steps: int = 3,
    preset: str = "debug",
    vocab_size: int = 512,
    batch_size: int = 2,
    seq_len: int = 32,
    lr: float = 1e-2,
    seed: int = 0,
    device: str | None = None,
    threads: int | None = None,
) -> dict:
    """Train ScratchDataParallel and the package's DDP (`apply_ddp`) side by side from the same
    start, on the same data; after every step compare their gradients and weights bit for bit,
    check the replicas still equal rank 0's, and count each one's collectives. Once per
    bucket size. Every rank starts from its *own* random weights: only the wrappers' broadcast
    from rank 0 makes the replicas equal."""
    env, _ = join(device, threads=threads, deterministic=True)
    args = ModelArgs.preset(preset, vocab_size=vocab_size, max_seq_len=seq_len)
    local = seeded_model(args, seed + env.rank, env.device)
    params = list(local.parameters())
    out = {
        "world_size": env.world_size,
        "num_params": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "num_tensors": len(params),
        "runs": {},
    }
    for cap in bucket_caps_mb:
        ddp = apply_ddp(copy.deepcopy(local), bucket_cap_mb=cap)
        scratch = ScratchDataParallel(copy.deepcopy(local), bucket_cap_mb=cap)
        run = {
            "scratch_bucket_sizes": scratch.bucket_sizes,
            "start_equal": all(
                torch.equal(a, b) for a, b in zip(ddp.parameters(), scratch.parameters())
            ),
            "own_init_replaced": any(
                not torch.equal(a, b) for a, b in zip(local.parameters(), scratch.parameters())
            ),
            "steps": [],
        }
        opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=lr)
        opt_scratch = torch.optim.AdamW(scratch.parameters(), lr=lr)
        for step in range(steps):
            x, y = _batch(args, batch_size, seq_len, env.device, seed, step, env.rank)
            with CommCounter() as cc_ddp:
                next_token_loss(ddp, x, y).backward()  # DDP all-reduces inside backward
            with CommCounter() as cc_scratch:
                next_token_loss(scratch, x, y).backward()
                scratch.sync_gradients()  # ours, after it
            g_ddp = [p.grad.clone() for p in ddp.parameters()]
            g_scratch = [p.grad.clone() for p in scratch.parameters()]
            for opt in (opt_ddp, opt_scratch):
                opt.step()
                opt.zero_grad(set_to_none=True)
            run["steps"].append(
                {
                    "grads_bitwise": all(torch.equal(a, b) for a, b in zip(g_ddp, g_scratch)),
                    "grads_max_rel_diff": _max_rel_diff(g_scratch, g_ddp),
                    "weights_bitwise": all(
                        torch.equal(a, b) for a, b in zip(ddp.parameters(), scratch.parameters())
                    ),
                    "replicas_equal": _equal_to_first_rank(scratch) and _equal_to_first_rank(ddp),
                    "ddp_all_reduce_bytes": _all_reduce_bytes(cc_ddp),
                    "scratch_all_reduce_bytes": _all_reduce_bytes(cc_scratch),
                    "ddp_ops": sorted({e.op for e in cc_ddp.events}),
                }
            )
        out["runs"][cap] = run
    # Without buckets: one all-reduce per parameter tensor, each paying a collective's latency.
    with CommCounter() as unbucketed:
        allreduce_mean_([p.detach().clone() for p in params])
    out["unbucketed_all_reduce_bytes"] = _all_reduce_bytes(unbucketed)
    return out


def accumulation_traffic(
    accum: int = 4,
    bucket_cap_mb: float = 25.0,
    preset: str = "debug",
    vocab_size: int = 512,
    batch_size: int = 2,
    seq_len: int = 32,
    seed: int = 0,
    device: str | None = None,
    threads: int | None = None,
) -> dict:
    """One optimizer step's gradient over `accum` micro-batches per rank, for both wrappers,
    syncing after every micro-batch or only after the last (`grad_sync`, the trainer's switch:
    `no_sync()` inside). Counts each variant's all-reduces; compares the gradients with each
    other and with ONE process running the whole global batch (every rank's micro-batches)."""
    env, _ = join(device, threads=threads, deterministic=True)
    args = ModelArgs.preset(preset, vocab_size=vocab_size, max_seq_len=seq_len)
    batches = {
        (r, k): _batch(args, batch_size, seq_len, env.device, seed, r, k)
        for r in range(env.world_size)
        for k in range(accum)
    }
    reference = seeded_model(args, seed, env.device)  # the weights rank 0 broadcasts
    x = torch.cat([batches[key][0] for key in sorted(batches)])
    y = torch.cat([batches[key][1] for key in sorted(batches)])
    next_token_loss(reference, x, y).backward()  # the mean over every token of the global batch
    big_batch = [p.grad for p in reference.parameters()]

    wrappers = {
        "scratch": lambda m: ScratchDataParallel(m, bucket_cap_mb=bucket_cap_mb),
        "ddp": lambda m: apply_ddp(m, bucket_cap_mb=bucket_cap_mb),
    }
    out = {
        "world_size": env.world_size,
        "accum": accum,
        "param_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
        "runs": {},
    }
    grads = {}
    for name, wrap in wrappers.items():
        for no_sync in (False, True):
            model = wrap(seeded_model(args, seed + env.rank, env.device))
            with CommCounter() as counter:
                for k in range(accum):
                    with grad_sync(model, sync=k == accum - 1 or not no_sync):
                        (next_token_loss(model, *batches[env.rank, k]) / accum).backward()
                        if name == "scratch":
                            model.sync_gradients()  # does nothing inside no_sync
            grads[name, no_sync] = [p.grad for p in model.parameters()]
            out["runs"][name, no_sync] = {
                "all_reduce_calls": len(_all_reduce_bytes(counter)),
                "all_reduce_bytes": sum(_all_reduce_bytes(counter)),
                "bus_bytes": counter.total_bus_bytes,
                "max_rel_diff_vs_big_batch": _max_rel_diff(grads[name, no_sync], big_batch),
            }
    out["no_sync_vs_every_micro_batch"] = {
        name: _max_rel_diff(grads[name, True], grads[name, False]) for name in wrappers
    }
    out["scratch_equals_ddp_bitwise"] = {
        no_sync: all(
            torch.equal(a, b) for a, b in zip(grads["scratch", no_sync], grads["ddp", no_sync])
        )
        for no_sync in (False, True)
    }
    return out


def allreduce_share(
    repeats: int = 10,
    warmup: int = 3,
    bucket_cap_mb: float = 25.0,
    preset: str = "debug",
    vocab_size: int | None = None,
    batch_size: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    device: str | None = None,
    threads: int | None = None,
) -> dict:
    """Time, `repeats` times, on a DDP model (`apply_ddp`):

        compute          forward + backward inside no_sync (no communication at all)
        synced           forward + backward as in training (DDP all-reduces buckets as
                         backward produces them, overlapping the two)
        optimizer        the AdamW step
        all_reduce       one all-reduce of a flat buffer as large as all gradients
        per_tensor       the same bytes, one all-reduce per parameter tensor (no buckets)

    Every timing starts after a barrier, so no rank measures its wait for a slower one.
    Rank 0 streams each repeat's times to the notebook (`report`); returns the medians."""
    env, _ = join(device, threads=threads, deterministic=True)
    args = ModelArgs.preset(preset, vocab_size=vocab_size, max_seq_len=seq_len)
    model = apply_ddp(seeded_model(args, seed, env.device), bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), device=env.device)
    tensors = [torch.zeros_like(p) for p in params]

    def fwd_bwd(step):
        x, y = _batch(args, batch_size, seq_len, env.device, seed, step, env.rank)
        next_token_loss(model, x, y).backward()

    def counted(fn, *args):
        with counter:  # each `with` starts from zero: the last repeat's collectives remain
            fn(*args)

    def timed(fn) -> float:
        dist.barrier()
        start = _clock(env.device)
        fn()
        return _clock(env.device) - start

    times = {k: [] for k in ("compute", "synced", "optimizer", "all_reduce", "per_tensor")}
    counter = CommCounter()
    for i in range(warmup + repeats):
        with model.no_sync():
            t_compute = timed(lambda i=i: fwd_bwd(i))
        model.zero_grad(set_to_none=True)
        t_synced = timed(lambda i=i: counted(fwd_bwd, i))
        t_optimizer = timed(optimizer.step)
        optimizer.zero_grad(set_to_none=True)
        t_all_reduce = timed(lambda: dist.all_reduce(flat))
        t_per_tensor = timed(lambda: [dist.all_reduce(t) for t in tensors])
        if i < warmup:  # first steps: allocations, DDP's bucket rebuild, gloo's connections
            continue
        for key, value in zip(
            times, (t_compute, t_synced, t_optimizer, t_all_reduce, t_per_tensor)
        ):
            times[key].append(value)
            if env.rank == 0:
                report({"kind": "train", "step": i - warmup + 1, "run": key, "ms": value * 1e3})
    median = {k: statistics.median(v) for k, v in times.items()}
    step = median["synced"] + median["optimizer"]
    return {
        "world_size": env.world_size,
        "rank": env.rank,
        "device": str(env.device),
        "param_bytes": flat.numel() * flat.element_size(),
        "num_tensors": len(params),
        "median_s": median,
        "times_s": times,
        "step_s": step,
        "all_reduce_share": median["all_reduce"] / step,
        "exposed_share": (median["synced"] - median["compute"]) / step,
        "bus_bytes_per_s": flat.numel()
        * flat.element_size()
        * 2
        * (env.world_size - 1)
        / env.world_size
        / median["all_reduce"],
        "synced_step_all_reduce_bytes": _all_reduce_bytes(counter),
        "synced_step_ops": sorted({e.op for e in counter.events}),
    }


def run_several(**experiments: dict) -> dict:
    """Run several of the experiments above in one job, each with its keyword arguments, so
    every rank pays its start-up (seconds of imports) once: {name: result}."""
    unknown = [name for name in experiments if name not in _EXPERIMENTS]
    if unknown:
        raise TitanliteError(
            f"unknown experiment(s) {', '.join(unknown)}: choose from {', '.join(_EXPERIMENTS)}"
        )
    return {name: _EXPERIMENTS[name](**kwargs) for name, kwargs in experiments.items()}


_EXPERIMENTS = {f.__name__: f for f in (scratch_vs_ddp, accumulation_traffic, allreduce_share)}
