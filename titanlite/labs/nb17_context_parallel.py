"""Notebook 17's context-parallel lab: ring attention checked against full attention, the work
and bytes of each rank counted against their formulas, activation memory measured per sequence
length, and the experiments each rank runs
(`launch_function("titanlite.labs.nb17_context_parallel:attention_matches_full", nproc=2)`; the
tests run them too).

The technique itself lives in distributed/context_parallel.py (apply_cp); this measures it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed.context_parallel import (
    ContextParallel,
    apply_cp,
    block_backward,
    block_forward,
    blocks,
)
from ..models.llama import ModelArgs, build_model
from ..tools.measure.comm import CommCounter
from ..tools.measure.host_syncs import HostSyncs

# ----- values and gradients: the ring against one process's full attention ---------------------


def random_qkv(batch, heads, kv_heads, seq_len, head_dim, seed=0, dtype=torch.float32):
    """q [B, H, T, D], k and v [B, H_kv, T, D], and an upstream gradient like q: the same on
    every rank (one seed), so each rank can compute the full attention to compare with."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, generator=g) for _ in range(2))
    dout = torch.randn(batch, heads, seq_len, head_dim, generator=g)
    return [t.to(dtype) for t in (q, k, v, dout)]


def full_attention_grads(q, k, v, dout):
    """One process's causal attention (torch SDPA) over the whole sequence: output and grads."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def context_attention_grads(cp: ContextParallel, q, k, v, dout):
    """This rank's part of the same, computed across the cp ranks: output and grads of its part."""
    q, k, v = (cp.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v))
    out = cp.attention(q, k, v)
    out.backward(cp.shard(dout, dim=2))
    return out.detach(), q.grad, k.grad, v.grad


def attention_matches_full(
    batch=2,
    heads=4,
    kv_heads=2,
    seq_len=64,
    head_dim=16,
    layout="zigzag",
    method="ring",
    kernel=None,
    seed=0,
):
    """Each rank: the largest difference between its part of the ring's output and gradients and
    the same part of full attention's (fp32), and the bytes its collectives moved."""
    rank, size = dist.get_rank(), dist.get_world_size()
    cp = ContextParallel(dist.group.WORLD, size, rank, layout, method, kernel=kernel)
    q, k, v, dout = random_qkv(batch, heads, kv_heads, seq_len, head_dim, seed)
    want = [cp.shard(t, dim=2) for t in full_attention_grads(q, k, v, dout)]
    with CommCounter() as counter, HostSyncs() as syncs:
        got = context_attention_grads(cp, q, k, v, dout)
    diffs = {
        name: (g - w).abs().max().item() for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)
    }
    return {"rank": rank, "diffs": diffs, "comm": counter.summary(), "host_syncs": syncs.sites}


def cp_comm_formula(batch, kv_heads, seq_len, head_dim, cp, method="ring", dtype_bytes=4):
    """Bytes one attention layer's forward and backward move per rank, as CommCounter counts
    them. K/V of a rank's part: kv = 2·B·H_kv·(T/cp)·D·bytes. Ring: the forward sends cp−1 K/V
    blocks; the backward sends them again, and the fp32 K/V gradients cp times (home again).
    Allgather: two all-gathers of cp·kv (forward, and again in the backward rather than keep
    it), one reduce-scatter of the fp32 gradients of all cp parts."""
    kv = 2 * batch * kv_heads * (seq_len // cp) * head_dim * dtype_bytes
    kv_grad = kv // dtype_bytes * 4
    if cp == 1:
        return {}
    if method == "ring":
        sent = 2 * (cp - 1) * kv + cp * kv_grad
        return {"send": sent, "recv": sent}
    return {"all_gather": 2 * cp * kv, "reduce_scatter": cp * kv_grad}


# ----- the work of each rank: counted from the blocks, and timed -------------------------------


def pair_flops(
    q_rank: int, kv_rank: int, cp: int, seq_len: int, layout: str, heads: int, head_dim: int
):
    """Forward attention FLOPs of one rank's queries against another rank's K/V (q·kᵀ and p·v,
    2 FLOPs a multiply-add), counting only the query-key pairs causal attention computes: a
    diagonal chunk half, as the package's `blocks` hands them to the kernel."""
    total = 0
    for rows, cols, causal in blocks(q_rank, kv_rank, cp, seq_len // cp, layout):
        pairs = (rows.stop - rows.start) * (cols.stop - cols.start)
        total += 2 * 2 * (pairs / 2 if causal else pairs) * head_dim * heads
    return total


def attention_flops_per_rank(seq_len: int, cp: int, layout: str, heads: int, head_dim: int):
    """Each rank's forward attention FLOPs over the whole ring (all the K/V it visits)."""
    return [
        sum(pair_flops(rank, source, cp, seq_len, layout, heads, head_dim) for source in range(cp))
        for rank in range(cp)
    ]


def ring_step_flops(seq_len: int, cp: int, rank: int, layout: str, heads: int, head_dim: int):
    """The forward FLOPs rank `rank` computes at each step of the ring, in the order it visits
    the K/V blocks (its own first, then the previous rank's, ...: ContextParallel.visits): the
    compute that each step's transfer of the next block can hide behind."""
    return [
        pair_flops(rank, (rank - step) % cp, cp, seq_len, layout, heads, head_dim)
        for step in range(cp)
    ]


def attention_seconds_per_rank(
    seq_len=2048, cp=4, layout="zigzag", batch=1, heads=4, head_dim=32, repeats=15, seed=0
):
    """CPU seconds of each rank's attention blocks (forward and backward, the CPU flash kernel),
    measured here one rank after another: the work alone, without the waiting that running the
    ranks at once on shared cores would mix in. On one thread, timed by that thread's CPU clock:
    on a busy machine the wall clock also counts the slices the OS gave other processes (at a
    load of 9 on 2 cores a rank's median round took up to 3.4× its fastest by the wall clock,
    1.1× by the CPU clock).
    A warm-up round first; then `repeats` rounds, each timing every rank in turn. Returns
    rounds[i][rank]."""
    q, k, v, dout = random_qkv(batch, heads, heads, seq_len // cp, head_dim, seed)

    def work(rank):
        start = time.thread_time()
        for source in range(cp):
            for rows, cols, causal in blocks(rank, source, cp, seq_len // cp, layout):
                q_, k_, v_ = q[:, :, rows], k[:, :, cols], v[:, :, cols]
                out, lse = block_forward("cpu_flash", q_, k_, v_, causal)
                block_backward("cpu_flash", dout[:, :, rows], q_, k_, v_, out, lse, causal)
        return time.thread_time() - start

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the thread's CPU clock then holds all of the work
    try:
        for rank in range(cp):
            work(rank)
        return [[work(rank) for rank in range(cp)] for _ in range(repeats)]
    finally:
        torch.set_num_threads(threads)


# ----- activation memory: what autograd keeps, per rank ----------------------------------------


def saved_activation_bytes(model, tokens) -> int:
    """Bytes of the tensors autograd saves for the backward in one forward of `model` (each
    storage counted once; parameters and buffers - the rotary tables - excluded): the activation
    memory a rank holds at its peak."""
    params = {p.untyped_storage().data_ptr() for p in (*model.parameters(), *model.buffers())}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).float().sum()
    return total


def activation_memory(seq_lens=(256, 512, 1024), layout="zigzag", preset="debug", seed=0):
    """Each rank: the activation bytes it saves for one sequence of each length, with its
    attention across the world's ranks (one process, or no process group: the whole sequence)."""
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    args = ModelArgs.preset(preset, max_seq_len=max(seq_lens))
    torch.manual_seed(seed)
    model = build_model(args)
    if size > 1:
        mesh = torch.distributed.device_mesh.init_device_mesh(
            "cpu", (size,), mesh_dim_names=("cp",)
        )
        cp = apply_cp(model, mesh["cp"], layout)
    out = {}
    for seq_len in seq_lens:
        tokens = torch.randint(0, args.vocab_size, (1, seq_len))
        local = cp.shard(tokens) if size > 1 else tokens
        out[seq_len] = saved_activation_bytes(model, local)
    return {"rank": rank, "bytes": out}


# ----- the whole model: logits and weight gradients against one process ----------------------


def model_matches_full(
    seq_len=64, layout="zigzag", method="ring", init_std=0.5, wrong_positions=False, seed=0
):
    """Each rank: the largest differences between the CP model's logits (its part) and summed
    weight gradients and one process's, on the same weights and tokens. A large `init_std`
    makes attention peaky, so a token at the wrong position changes the result: with
    `wrong_positions` every rank numbers its tokens from 0 (the bug a test must catch)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    args = ModelArgs.preset("debug", max_seq_len=seq_len, init_std=init_std)
    tokens = torch.randint(
        0, args.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed)
    )
    torch.manual_seed(seed)
    full = build_model(args)
    torch.manual_seed(seed)
    model = build_model(args)
    want = full(tokens)
    want.float().pow(2).sum().backward()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (size,), mesh_dim_names=("cp",))
    cp = apply_cp(model, mesh["cp"], layout, method)
    if wrong_positions:
        cp.positions = lambda local_len, device=None: torch.arange(local_len, device=device)
    got = model(cp.shard(tokens))
    got.float().pow(2).sum().backward()
    grads = {}
    for (name, p), q in zip(model.named_parameters(), full.parameters()):
        dist.all_reduce(p.grad)  # each rank's tokens' share of the gradient: summed
        grads[name] = ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
    logits = ((got - cp.shard(want)).abs().max() / want.abs().max()).item()
    return {"rank": rank, "logits": logits, "grads": max(grads.values())}


# ----- memory before anything allocates: preflight's floor, written out -------------------------


def memory_floor_formula(
    params, bytes_per_param, shards, micro_batch, seq_len, cp, vocab, logit_bytes, tp=1, pp=1
) -> float:
    """A floor of one rank's memory, written out as notebook 17 does: its share of the weights,
    gradients and optimizer moments, bytes_per_param · Ψ / (shards · tp · pp), where FSDP's shards
    are dp_shard × cp (CP ranks hold the same weights); plus, for each of its micro-batch's
    sequences, its seq_len / cp tokens' logits and their gradient, vocab / tp wide, and 16 bytes
    of tokens each. preflight refuses a run above the device's memory by the same floor."""
    state = bytes_per_param * params / (shards * tp * pp)
    return state + micro_batch * seq_len / cp * (vocab / tp * 2 * logit_bytes + 16)
