"""Data parallelism from scratch vs torch's DDP, and counting the collectives both (and FSDP2)
issue. One 2-process gloo run (torchrun) measures everything; the tests assert on its numbers.

This file is also the worker: torchrun runs it as a script (`python -m torch.distributed.run
... test_comm_and_scratch_ddp.py OUT_DIR`) and each rank writes OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_torchrun

WORLD = 2
VOCAB, SEQ, MICRO = 256, 16, 2
SMALL_CAP_MB = 0.02  # ~21 kB: the debug Llama splits into several buckets
STEPS = 3  # DDP rebuilds its buckets after the first step: look at two more


# ----------------------------------------------------------------------------- the worker
def _llama(seed: int, dtype=torch.float32):
    from titanlite.models.llama import ModelArgs, build_model

    torch.manual_seed(seed)
    return build_model(ModelArgs.preset("debug", vocab_size=VOCAB, max_seq_len=SEQ)).to(dtype)


def _batch(*key: int):
    """Tokens and targets that depend only on `key` (step, rank, micro-batch, ...)."""
    g = torch.Generator().manual_seed(hash(key) % 2**31)
    x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _all_reduce_bytes(cc) -> list[int]:
    return [e.bytes for e in cc.events if e.op == "all_reduce"]


def _ddp_bucket_sizes(ddp) -> list[int]:
    # The reducer's own buckets (flat buffers), read back from C++.
    return [
        b.buffer().numel() * b.buffer().element_size()
        for b in ddp.reducer._get_zeros_like_grad_buckets()
    ]


def _scratch_vs_ddp(rank: int, cap_mb: float) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from titanlite.labs.nb07_scratch_ddp import ScratchDataParallel
    from titanlite.tools.measure.comm import CommCounter

    local = _llama(seed=rank)  # replicas start different: only the broadcast equalises them
    ddp = DDP(copy.deepcopy(local), bucket_cap_mb=cap_mb)
    scratch = ScratchDataParallel(copy.deepcopy(local), bucket_cap_mb=cap_mb)
    out = {
        "num_params": sum(p.numel() for p in local.parameters()),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in local.buffers()),
        "scratch_buckets": scratch.num_buckets,
        "scratch_bucket_sizes": scratch.bucket_sizes,
        "start_equal": all(
            torch.equal(a, b) for a, b in zip(ddp.module.parameters(), scratch.module.parameters())
        ),
        "start_moved": any(
            not torch.equal(a, b) for a, b in zip(local.parameters(), scratch.module.parameters())
        ),
        "steps": [],
    }
    opt_d = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    opt_s = torch.optim.AdamW(scratch.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        with CommCounter() as cc_ddp:
            _loss(ddp, x, y).backward()
        with CommCounter() as cc_scratch:
            _loss(scratch, x, y).backward()
            scratch.sync_gradients()
        grads_d = [p.grad for p in ddp.parameters()]
        grads_s = [p.grad for p in scratch.parameters()]
        record = {
            "grads_bitwise": all(torch.equal(a, b) for a, b in zip(grads_d, grads_s)),
            "grads_max_diff": max((a - b).abs().max().item() for a, b in zip(grads_d, grads_s)),
            "ddp_bucket_sizes": _ddp_bucket_sizes(ddp),
            "ddp_all_reduce_bytes": _all_reduce_bytes(cc_ddp),
            "ddp_broadcast_bytes": [e.bytes for e in cc_ddp.events if e.op == "broadcast"],
            "ddp_ops": sorted({e.op for e in cc_ddp.events}),
            "scratch_all_reduce_bytes": _all_reduce_bytes(cc_scratch),
            "scratch_summary": cc_scratch.summary(),
        }
        opt_d.step()
        opt_s.step()
        opt_d.zero_grad()
        opt_s.zero_grad()
        record["weights_bitwise"] = all(
            torch.equal(a, b) for a, b in zip(ddp.parameters(), scratch.parameters())
        )
        # Replicas must stay equal across ranks: compare a checksum with the other rank's.
        checksum = torch.stack([p.double().sum() for p in scratch.parameters()]).sum().reshape(1)
        both = [torch.zeros(1, dtype=torch.float64) for _ in range(WORLD)]
        dist.all_gather(both, checksum)
        record["replicas_equal"] = bool(both[0] == both[1])
        out["steps"].append(record)
    return out


def _accumulation(rank: int, accum: int = 2) -> dict:
    """k micro-batches per rank under no_sync, one sync at the end, vs one process running
    the whole global batch (all ranks' micro-batches) at once. float64, so the only
    difference is the summation order."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from titanlite.labs.nb07_scratch_ddp import ScratchDataParallel
    from titanlite.tools.measure.comm import CommCounter

    batches = {(r, k): _batch(100, r, k) for r in range(WORLD) for k in range(accum)}
    reference = _llama(seed=0, dtype=torch.float64)  # what rank 0 broadcasts
    x = torch.cat([batches[key][0] for key in sorted(batches)])
    y = torch.cat([batches[key][1] for key in sorted(batches)])
    _loss(reference, x, y).backward()

    scratch = ScratchDataParallel(
        _llama(seed=rank, dtype=torch.float64), bucket_cap_mb=SMALL_CAP_MB
    )
    ddp = DDP(_llama(seed=rank, dtype=torch.float64), bucket_cap_mb=SMALL_CAP_MB)
    counts = {}
    for name, model in (("scratch", scratch), ("ddp", ddp)):
        with CommCounter() as during_no_sync, model.no_sync():
            for k in range(accum - 1):
                (_loss(model, *batches[rank, k]) / accum).backward()
                if name == "scratch":
                    model.sync_gradients()  # a no-op inside no_sync: the point of the test
        with CommCounter() as last:
            (_loss(model, *batches[rank, accum - 1]) / accum).backward()
            if name == "scratch":
                model.sync_gradients()
        counts[name] = {
            "no_sync_ops": [e.op for e in during_no_sync.events],
            "last_all_reduces": len(_all_reduce_bytes(last)),
        }
    ref = [p.grad for p in reference.parameters()]
    sg = [p.grad for p in scratch.parameters()]
    dg = [p.grad for p in ddp.parameters()]
    return {
        "counts": counts,
        "scratch_buckets": scratch.num_buckets,
        "max_rel_err": max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(sg, ref)),
        "max_abs_err": max((a - b).abs().max().item() for a, b in zip(sg, ref)),
        "scratch_vs_ddp_bitwise": all(torch.equal(a, b) for a, b in zip(sg, dg)),
    }


def _fsdp2(rank: int) -> dict:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titanlite.tools.measure.comm import CommCounter

    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for reshard in (True, False):  # ZeRO-3 (re-gather in backward) vs ZeRO-2 (keep gathered)
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32)
        )
        full_bytes = [
            sum(p.numel() * p.element_size() for p in m.parameters())
            for m in model
            if isinstance(m, nn.Linear)
        ]
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
        local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
        with CommCounter() as fwd:
            y = model(x)
        with CommCounter() as bwd:
            y.square().sum().backward()
        out[f"reshard_{reshard}"] = {
            "full_bytes": full_bytes,
            "local_bytes": local_bytes,
            "forward": fwd.summary(),
            "backward": bwd.summary(),
            "forward_all_gather_bytes": [e.bytes for e in fwd.events if e.op == "all_gather"],
            "backward_reduce_scatter_bytes": [
                e.bytes for e in bwd.events if e.op == "reduce_scatter"
            ],
        }
    return out


def _plain_collectives(rank: int) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from titanlite.tools.measure.comm import CommCounter

    t = torch.full((1000,), float(rank))
    with CommCounter() as cc:
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        dist.all_gather_into_tensor(torch.empty(2000), t)
        dist.reduce_scatter_tensor(torch.empty(500), t)
        funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))
    from titanlite.labs.nb07_scratch_ddp import allreduce_mean_

    tensors = [torch.full((3,), float(rank)), torch.full((5,), 2.0 * rank)]
    with CommCounter() as unbucketed:
        allreduce_mean_(tensors)
    return {
        "events": [[e.op, e.bytes, e.group_size, e.bus_bytes] for e in cc.events],
        "table": cc.table(),
        "total_bytes": cc.total_bytes,
        "mean": [t.tolist() for t in tensors],
        "unbucketed_bytes": [e.bytes for e in unbucketed.events if e.op == "all_reduce"],
    }


def _worker(out_dir: str) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore", FutureWarning)  # deprecation notes of collective names
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {
        "one_bucket": _scratch_vs_ddp(rank, 25.0),
        "small_buckets": _scratch_vs_ddp(rank, SMALL_CAP_MB),
        "accumulation": _accumulation(rank),
        "fsdp2": _fsdp2(rank),
        "plain": _plain_collectives(rank),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # nobody tears down the group while the other rank still uses it
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dp")
    run_torchrun(__file__, out, nproc=WORLD)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("case", ["one_bucket", "small_buckets"])
def test_scratch_gradients_and_weights_equal_ddp_bitwise(runs, case):
    """At 2 ranks both compute g0·½ + g1·½ (DDP multiplies by 1/world while copying into its
    bucket; we too): ×½ is exact and a+b = b+a, so the results are identical bit for bit."""
    for run in runs:
        r = run[case]
        assert r["start_equal"]
        for step in r["steps"]:
            assert step["grads_bitwise"], step["grads_max_diff"]
            assert step["weights_bitwise"]
            assert step["replicas_equal"]
    assert runs[1][case]["start_moved"]  # rank 1's own init was replaced by rank 0's


def test_scratch_buckets_match_ddp_buckets_and_every_bucket_is_counted(runs):
    for run in runs:
        r = run["small_buckets"]
        assert r["scratch_buckets"] > 3
        first, *later = r["steps"]
        # Step 1: DDP (find_unused_parameters=False) starts with ONE bucket of everything...
        assert first["ddp_all_reduce_bytes"] == [4 * r["num_params"]]
        for step in later:
            # ...then rebuilds buckets in the order gradients arrived: the same as ours.
            assert step["ddp_bucket_sizes"] == r["scratch_bucket_sizes"]
            assert step["ddp_all_reduce_bytes"] == step["ddp_bucket_sizes"]  # one per bucket
        for step in r["steps"]:
            assert step["scratch_all_reduce_bytes"] == r["scratch_bucket_sizes"]
            assert step["scratch_summary"]["all_reduce"]["bytes"] == 4 * r["num_params"]
            assert set(step["scratch_summary"]) == {"all_reduce"}
        # DDP re-broadcasts rank 0's buffers (the rotary tables) at every forward
        # (broadcast_buffers=True), and the rebuild costs two small broadcasts in step 2
        # (bucket indices and sizes, from rank 0, so every rank buckets alike).
        broadcasts = [step["ddp_broadcast_bytes"] for step in r["steps"]]
        assert [b[-1] for b in broadcasts] == [r["buffer_bytes"]] * STEPS
        assert [len(b) for b in broadcasts] == [1, 3] + [1] * (STEPS - 2)


def test_one_bucket_is_one_all_reduce_of_all_parameters(runs):
    for run in runs:
        r = run["one_bucket"]
        assert r["scratch_bucket_sizes"] == [4 * r["num_params"]]
        for step in r["steps"]:
            assert step["ddp_all_reduce_bytes"] == [4 * r["num_params"]]
            assert step["scratch_all_reduce_bytes"] == [4 * r["num_params"]]


def test_no_sync_accumulation_equals_the_big_batch(runs):
    for run in runs:
        a = run["accumulation"]
        assert a["counts"]["scratch"]["no_sync_ops"] == []  # no collective at all
        # DDP skips its all-reduce too; what is left is its per-forward buffer broadcast.
        assert a["counts"]["ddp"]["no_sync_ops"] == ["broadcast"]
        assert a["counts"]["scratch"]["last_all_reduces"] == a["scratch_buckets"]
        assert a["counts"]["ddp"]["last_all_reduces"] == 1  # DDP's first step: one bucket
        assert a["scratch_vs_ddp_bitwise"]
        # float64: only the summation order differs from the one-process big batch.
        # Measured ~1e-15 (a few ulp of the largest entry): 100x margin.
        assert a["max_rel_err"] < 1e-13, a


def test_fsdp2_collective_volume(runs):
    for run in runs:
        for reshard, regather in (("reshard_True", True), ("reshard_False", False)):
            f = run["fsdp2"][reshard]
            full = f["full_bytes"]
            assert f["local_bytes"] * WORLD == sum(full)  # each rank holds half of each Linear
            # Forward gathers every Linear's full parameters, once, in layer order.
            assert f["forward_all_gather_bytes"] == full
            assert set(f["forward"]) == {"all_gather"}
            # Backward reduce-scatters every Linear's full gradient, last layer first...
            assert f["backward_reduce_scatter_bytes"] == full[::-1]
            # ...and re-gathers the parameters only where they were freed after forward.
            gathered = f["backward"].get("all_gather", {"bytes": 0})["bytes"]
            assert gathered == (sum(full) if regather else 0)
            rs = f["backward"]["reduce_scatter"]
            assert rs["bus_bytes"] == pytest.approx(rs["bytes"] * (WORLD - 1) / WORLD)


def test_plain_and_functional_collectives_are_counted(runs):
    n, size = WORLD, 1000 * 4
    expected = [
        ["all_reduce", size, n, size * 2 * (n - 1) / n],
        ["broadcast", size, n, size],
        ["all_gather", n * size, n, n * size * (n - 1) / n],
        ["reduce_scatter", size, n, size * (n - 1) / n],
        ["all_reduce", size, n, size * 2 * (n - 1) / n],
    ]
    for run in runs:
        assert run["plain"]["events"] == expected
        assert run["plain"]["total_bytes"] == sum(e[1] for e in expected)
        assert "all_reduce" in run["plain"]["table"]
        # allreduce_mean_: the mean of ranks 0 and 1, one all-reduce per tensor.
        assert run["plain"]["mean"] == [[0.5] * 3, [1.0] * 5]
        assert run["plain"]["unbucketed_bytes"] == [3 * 4, 5 * 4]


if __name__ == "__main__":
    from titanlite.distributed.env import exit_worker

    _worker(sys.argv[1])
    exit_worker(0)
