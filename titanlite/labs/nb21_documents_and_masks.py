"""Notebook 21's lab: packed documents, the block-causal mask they need, and what a block-sparse
kernel saves by it. From scratch: a block-sparse attention that computes only the query-key blocks
the mask keeps (what FlexAttention's BlockMask does), proven equal to SDPA with the dense mask in
values and gradients (tests/test_document_mask.py); counted (blocks, FLOPs) and timed beside SDPA
and compiled FlexAttention; and the masked context-parallel check each rank runs
(`launch_function("titanlite.labs.nb21_documents_and_masks:masked_cp_matches_one_process", nproc=2)`).

The technique itself lives in models/masked_attention.py (apply_masked_attention) and
data/sampler.py (which document each token is in); this measures it.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed.context_parallel import ContextParallel
from ..models.masked_attention import MaskedAttention
from .nb04_sdpa_kernels import sdpa_kernel_for

# ----- the mask, from the documents ----------------------------------------------------------


def documents_of(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each token's document [B, T], numbered from 0 in each row: a document starts at each
    end-of-document token (which opens it, as a BOS would), as data/sampler.py numbers them."""
    return (tokens == eos_id).cumsum(-1, dtype=torch.int32)


def stream_documents(windows: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Which document of the whole token stream each token of each window [N, T+1] is in: the
    windows cut the stream in order, so numbering over the flattened stream names each document
    once, wherever it lands (for drawing the packing)."""
    return documents_of(windows.flatten(), eos_id).view(windows.shape)


def pair_mask(documents: torch.Tensor) -> torch.Tensor:
    """The dense block-causal mask [B, T, T]: query q attends key k when k <= q, same document."""
    T = documents.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, :, None] == documents[:, None, :]) & causal


def block_layout(documents: torch.Tensor, block: int) -> torch.Tensor:
    """[B, T/block, T/block]: 0 where a query block and a key block have no pair that attends
    (never computed), 1 where some do (computed, then masked), 2 where all do (computed whole):
    the three kinds FlexAttention's BlockMask keeps apart. Read off the documents of each block's
    first and last token (documents only grow along a row), never the T × T pairs: key block j
    below the diagonal shares a document with query block i when its last token's document is
    the one i's first token is in, and every pair attends when j's first token's document is
    i's last token's; a diagonal block is causal, so partial (unless a block is one token)."""
    first, last = documents[:, ::block], documents[:, block - 1 :: block]
    n = first.shape[1]
    below = torch.ones(n, n, dtype=torch.bool, device=documents.device).tril(-1)
    diagonal = torch.eye(n, dtype=torch.bool, device=documents.device)
    kept = (below & (last[:, None, :] == first[:, :, None])) | diagonal
    full = (below & (first[:, None, :] == last[:, :, None])) | (diagonal & (block == 1))
    return kept.to(torch.int8) + full.to(torch.int8)


def block_plan(documents: torch.Tensor, block: int) -> list:
    """What a block-sparse kernel reads from the mask, worked out once a batch (as FlexAttention's
    BlockMask is): for each row and query block, the first key block it needs (under a
    block-causal mask the kept key blocks are one run, from the block where the document of its
    first query starts to the diagonal) and, where any of them is partial, the pairs to mask."""
    layout, allowed = block_layout(documents, block), pair_mask(documents)
    plan = []
    for b in range(documents.shape[0]):
        row = []
        for i in range(documents.shape[1] // block):
            kept = layout[b, i].nonzero().flatten()
            first = int(kept[0])
            assert kept.tolist() == list(range(first, i + 1)), "not a block-causal mask"
            keys = slice(first * block, (i + 1) * block)
            partial = bool((layout[b, i, first : i + 1] == 1).any())
            row.append((first, ~allowed[b, i * block : (i + 1) * block, keys] if partial else None))
        plan.append(row)
    return plan


def block_sparse_attention(q, k, v, documents, block: int = 64, plan=None) -> torch.Tensor:
    """softmax(q·kᵀ/√d)·v under the block-causal mask, computing only the key blocks each query
    block needs (`block_plan`; given, or worked out here): the keys of skipped blocks are never
    read, and only partial blocks are masked (full ones need no mask, as in flex). Plain torch
    ops, so autograd gives the gradients, through the same blocks. q [B, H, T, D]; k, v
    [B, H_kv, T, D]; T a multiple of `block`."""
    B, H, T, D = q.shape
    groups = H // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    plan = plan if plan is not None else block_plan(documents, block)
    q = q / D**0.5  # scaled once: T·d multiplies, not T² divides
    rows = []
    for b in range(B):
        parts = []
        for i, (first, masked_out) in enumerate(plan[b]):
            queries, keys = slice(i * block, (i + 1) * block), slice(first * block, (i + 1) * block)
            scores = q[b, :, queries] @ k[b, :, keys].transpose(-1, -2)
            if masked_out is not None:  # in place: the scores are this block's own
                scores.masked_fill_(masked_out, float("-inf"))
            parts.append(scores.softmax(-1) @ v[b, :, keys])
        rows.append(torch.cat(parts, dim=1))
    return torch.stack(rows)


def masked_sdpa(q, k, v, documents) -> torch.Tensor:
    """The reference: SDPA with the dense boolean mask (models/masked_attention.py's sdpa)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=pair_mask(documents)[:, None], enable_gqa=q.shape[1] != k.shape[1]
    )


# ----- what the mask saves: pairs, blocks, FLOPs -----------------------------------------------


def attended_fractions(documents: torch.Tensor) -> dict:
    """The fraction of all T² query-key pairs that attend, causal vs block-causal, over a batch."""
    T = documents.shape[-1]
    causal = T * (T + 1) / 2 / T**2
    return {"causal": causal, "block_causal": pair_mask(documents).float().mean().item()}


def block_counts(documents: torch.Tensor, block: int) -> dict:
    """Query-key blocks of a batch by kind, against causal attention's (the lower triangle of
    blocks, diagonal included), and the fraction of causal's blocks the document mask skips."""
    layout = block_layout(documents, block)
    n, B = layout.shape[-1], layout.shape[0]
    causal = B * n * (n + 1) // 2
    kept = int((layout > 0).sum())
    return {
        "blocks": B * n * n,
        "causal": causal,
        "kept": kept,
        "full": int((layout == 2).sum()),
        "partial": int((layout == 1).sum()),
        "skipped_of_causal": 1 - kept / causal,
    }


def attention_flops(kept_blocks: int, block: int, heads: int, head_dim: int) -> int:
    """Forward FLOPs of the kept blocks: q·kᵀ and probabilities·v, 2·block²·d each, per head."""
    return kept_blocks * heads * 4 * block * block * head_dim


# ----- time: forward passes on this machine ----------------------------------------------------


def random_qkv(batch, heads, kv_heads, seq_len, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, generator=g) for _ in range(2))
    return q, k, v


def attention_kinds(documents: torch.Tensor, block: int, flex_compiled=None) -> dict:
    """The forward passes the notebook times, each a function of (q, k, v): SDPA causal (no
    document mask: the floor a masked kernel competes with) and with the dense boolean mask; the
    from-scratch block-sparse attention and FlexAttention (`flex_compiled`: torch.compile'd
    flex_attention; None leaves it out), each twice: over every causal block (one document) and
    over the blocks the document mask keeps. The same code both times (flex: one compiled graph,
    its BlockMask an input), so their ratio is what skipping blocks saves."""
    dense = pair_mask(documents)[:, None]
    one_document = torch.zeros_like(documents)
    kinds = {
        "SDPA causal": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
        "SDPA dense mask": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, enable_gqa=True
        ),
    }
    for what, docs in (("causal blocks", one_document), ("kept blocks", documents)):
        plan = block_plan(docs, block)  # once, as a BlockMask is built once a batch
        kinds[f"scratch, {what}"] = lambda q, k, v, docs=docs, plan=plan: block_sparse_attention(
            q, k, v, docs, block, plan
        )
        if flex_compiled is not None:
            mask = MaskedAttention("flex").mask_for(docs, docs.shape[1], docs.device)
            kinds[f"flex, {what}"] = lambda q, k, v, mask=mask: flex_compiled(
                q, k, v, block_mask=mask, enable_gqa=True
            )
    return kinds


@torch.no_grad()
def time_forward(kinds: dict, q, k, v, rounds: int = 5) -> dict:
    """Seconds of each kind's forward in every round, the kinds in turn in each round (a machine
    that slows down slows them all), after one warm-up call each."""
    times = {name: [] for name in kinds}
    wait = torch.cuda.synchronize if q.is_cuda else lambda: None  # a GPU runs ahead of the clock
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in kinds.values():
            fn(q, k, v)
        for _ in range(rounds):
            for name, fn in kinds.items():
                wait()
                start = time.perf_counter()
                fn(q, k, v)
                wait()
                times[name].append(time.perf_counter() - start)
    return times


# ----- which SDPA kernel takes a mask -----------------------------------------------------------


def cpu_sdpa_choice(masked: bool, dtype: torch.dtype, gqa: bool = True) -> str:
    """The kernel SDPA picks on this CPU, asked of torch itself (torch._fused_sdp_choice) for a
    training call of the debug model's attention shape."""
    from torch.nn.attention import SDPBackend

    q = torch.zeros(1, 4, 64, 16, dtype=dtype, requires_grad=True)
    k = torch.zeros(1, 2 if gqa else 4, 64, 16, dtype=dtype)
    mask = torch.ones(64, 64, dtype=torch.bool).tril()[None, None] if masked else None
    choice = torch._fused_sdp_choice(q, k, k, mask, 0.0, not masked, enable_gqa=gqa)
    return SDPBackend(choice).name.lower().replace("_attention", "")


def cuda_sdpa_choice(masked: bool, dtype, capability, head_dim: int = 128) -> str:
    """Predicted from the GPU's facts by torch's rules (labs/nb04_sdpa_kernels.py): a boolean
    mask rules out flash (sdp_utils.cpp's check_for_attn_mask); cuDNN, where torch puts it first,
    and the memory-efficient kernel take one. A current build: cuDNN 9.15.1, CUDA 12.8."""
    return sdpa_kernel_for(
        "cuda",
        dtype,
        head_dim,
        gqa=True,
        capability=capability,
        cudnn_version=91501,
        cuda_version="12.8",
        masked=masked,
    )


# ----- context parallel: each rank's queries against every key, masked --------------------------


def masked_cp_matches_one_process(
    batch=2, heads=4, kv_heads=2, seq_len=64, head_dim=16, layout="zigzag", seed=0
):
    """Each rank: the largest difference between its part of the all-gather masked attention
    (output and gradients) and the same part of one process's masked SDPA over the whole batch,
    with documents of random lengths (the same on every rank: one seed)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    cp = ContextParallel(dist.group.WORLD, size, rank, layout, "allgather")
    q, k, v = random_qkv(batch, heads, kv_heads, seq_len, head_dim, seed)
    g = torch.Generator().manual_seed(seed + 1)
    documents = (torch.rand(batch, seq_len, generator=g) < 0.08).cumsum(-1, dtype=torch.int32)
    dout = torch.randn(batch, heads, seq_len, head_dim, generator=g)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = masked_sdpa(*whole, documents)
    out.backward(dout)
    want = [cp.shard(t, dim=2) for t in (out.detach(), *(t.grad for t in whole))]
    mine = [cp.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
    masked = MaskedAttention("sdpa")
    got = masked.attend(*mine, masked.mask_for(documents, seq_len // size, "cpu", cp), cp)
    got.backward(cp.shard(dout, dim=2))
    got = [got.detach(), *(t.grad for t in mine)]
    diffs = {n: (a - b).abs().max().item() for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    return {"rank": rank, "diffs": diffs, "documents": int(documents[:, -1].max()) + 1}
